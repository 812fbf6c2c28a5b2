//! A simulated network for benchmarks and tests (issue 42): a communicator wrapper that holds
//! every call back by a latency plus the bytes this rank passes over a bandwidth, so that
//! `genslm bench train --simulate-network 20ms,1GB/s` shows on one machine what a step costs
//! when messages cross a slow link, and how much of that overlap hides. Never in the path of a
//! normal run: only `RunOptions::network` applies it.
//!
//! The delay is paid before the call by the rank making it: `latency + bytes / bandwidth`, with
//! `bytes` what the rank hands over (its send buffer; for a receive, the buffer it fills).

use std::str::FromStr;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::parallel::hooked::Hook;

const BANDWIDTH: &str = "the bandwidth must be at least 1 B/s, in B/s, KB/s, MB/s, GB/s, TB/s \
     (powers of 1000), KiB/s, MiB/s, GiB/s, or bits: Kb/s, Mb/s, Gb/s, Tb/s";

/// `" 20 ms "` → `("20", "ms")`: the number (digits, sign, point, exponent) and the unit after it.
fn split_unit(text: &str) -> (&str, &str) {
    let t = text.trim();
    let mut end = 0;
    for (i, c) in t.char_indices() {
        let exponent = (c == 'e' || c == 'E') && i > 0;
        let sign = (c == '+' || c == '-') && (i == 0 || t[..i].ends_with(['e', 'E']));
        if c.is_ascii_digit() || c == '.' || exponent || sign {
            end = i + c.len_utf8();
        } else {
            break;
        }
    }
    (t[..end].trim(), t[end..].trim())
}

/// Latency and bandwidth of the simulated link.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NetSim {
    pub latency: Duration,
    pub bytes_per_s: f64,
}

impl NetSim {
    /// The hold-back of a call that moves `bytes`.
    pub fn delay(&self, bytes: usize) -> Duration {
        self.latency + Duration::from_secs_f64(bytes as f64 / self.bytes_per_s)
    }
}

impl FromStr for NetSim {
    type Err = Error;

    /// `LATENCY,BANDWIDTH`: e.g. `20ms,1GB/s`, `500us,10Gb/s`. Latency in s, ms or us;
    /// bandwidth in B/s, KB/s, MB/s, GB/s (powers of 1000), or bits (`Gb/s`, …).
    fn from_str(s: &str) -> Result<Self> {
        let bad = |why: &str| {
            Error::Invalid(format!(
                "--simulate-network {s:?}: {why}; expected LATENCY,BANDWIDTH such as 20ms,1GB/s"
            ))
        };
        let (lat, bw) = s.split_once(',').ok_or_else(|| bad("no comma"))?;
        if bw.contains(',') {
            return Err(bad("more than one comma"));
        }
        let (num, unit) = split_unit(lat);
        let scale = match unit {
            "us" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "" => return Err(bad("the latency needs a unit: s, ms or us")),
            other => {
                return Err(bad(&format!(
                    "'{other}' is no latency unit genslm reads: use s, ms or us"
                )))
            }
        };
        let latency = num
            .parse::<f64>()
            .ok()
            .filter(|x| x.is_finite() && *x >= 0.0 && x * scale <= 3600.0)
            .ok_or_else(|| bad("the latency must be a number from 0 to 3600 s"))?;
        let (num, unit) = split_unit(bw);
        let Some(rate) = unit.strip_suffix("/s") else {
            return Err(bad(&format!(
                "the bandwidth is a rate: '{unit}' needs '/s' ({BANDWIDTH})"
            )));
        };
        let k = match rate {
            "B" => 1.0,
            "KB" => 1e3,
            "MB" => 1e6,
            "GB" => 1e9,
            "TB" => 1e12,
            "KiB" => 1024.0,
            "MiB" => 1024.0 * 1024.0,
            "GiB" => 1024.0 * 1024.0 * 1024.0,
            "Kb" => 1e3 / 8.0,
            "Mb" => 1e6 / 8.0,
            "Gb" => 1e9 / 8.0,
            "Tb" => 1e12 / 8.0,
            other => {
                return Err(bad(&format!(
                    "'{other}/s' is no bandwidth unit genslm reads ({BANDWIDTH})"
                )))
            }
        };
        let bytes_per_s = num
            .parse::<f64>()
            .ok()
            .map(|x| x * k)
            .filter(|x| x.is_finite() && *x >= 1.0)
            .ok_or_else(|| bad(BANDWIDTH))?;
        Ok(NetSim {
            latency: Duration::from_secs_f64(latency * scale),
            bytes_per_s,
        })
    }
}

/// Wrapped in a [`Hooked`](crate::parallel::hooked::Hooked) communicator, a link holds each
/// call back before it runs.
impl Hook for NetSim {
    /// One rank alone sends nothing and pays nothing.
    fn around<T>(&self, size: usize, bytes: usize, call: impl FnOnce() -> T) -> T {
        if size > 1 {
            std::thread::sleep(self.delay(bytes));
        }
        call()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::parallel::hooked::Hooked;
    use crate::parallel::threads::thread_group;
    use std::sync::Arc;

    #[test]
    fn links_parse_with_their_units_and_bad_ones_are_refused() {
        let n: NetSim = "20ms,1GB/s".parse().unwrap();
        assert_eq!((n.latency, n.bytes_per_s), (Duration::from_millis(20), 1e9));
        let n: NetSim = " 500us , 10Gb/s".parse().unwrap();
        assert_eq!(
            (n.latency, n.bytes_per_s),
            (Duration::from_micros(500), 1.25e9)
        );
        let n: NetSim = "0s,100MB/s".parse().unwrap();
        assert_eq!(n.delay(1_000_000), Duration::from_millis(10));
        // Units named by what they are; TB/s and binary prefixes read.
        let n: NetSim = "1e1ms,1TB/s".parse().unwrap();
        assert_eq!(
            (n.latency, n.bytes_per_s),
            (Duration::from_millis(10), 1e12)
        );
        let n: NetSim = "1ms,2MiB/s".parse().unwrap();
        assert_eq!(n.bytes_per_s, 2.0 * 1024.0 * 1024.0);
        for (bad, why) in [
            ("20ms", "no comma"),
            ("20,1GB/s", "needs a unit"),
            ("-1ms,1GB/s", "from 0 to 3600"),
            ("20ns,1GB/s", "'ns' is no latency unit"),
            ("20ms,1GB", "'GB' needs '/s'"),
            ("20ms,1PB/s", "'PB/s' is no bandwidth unit"),
            ("20ms,1GB/s,extra", "more than one comma"),
            ("20ms,0B/s", "bandwidth must be"),
            ("1e9s,1GB/s", "from 0 to 3600"),
        ] {
            let e = bad.parse::<NetSim>().unwrap_err().to_string();
            assert!(e.contains(why) && e.contains(bad), "{bad}: {e}");
        }
    }

    /// An all-reduce of 1 MB over a 50 ms, 100 MB/s link takes at least 60 ms and gives the
    /// sum; one rank alone pays nothing.
    #[test]
    fn calls_wait_for_the_link_and_return_what_they_would() {
        let net: NetSim = "50ms,100MB/s".parse().unwrap();
        let handles: Vec<_> = thread_group(2, Duration::from_secs(10))
            .into_iter()
            .map(|c| {
                std::thread::spawn(move || {
                    let c = Hooked::wrap(Arc::new(c), net);
                    let mut buf = vec![c.rank() as f32 + 1.0; 250_000];
                    let t = Instant::now();
                    c.all_reduce_sum(&mut buf).unwrap();
                    (t.elapsed(), buf[0])
                })
            })
            .collect();
        for h in handles {
            let (took, sum) = h.join().unwrap();
            assert_eq!(sum, 3.0);
            assert!(took >= Duration::from_millis(60), "{took:?}");
        }
        let solo = Hooked::wrap(Arc::new(crate::parallel::comm::Solo), net);
        let t = Instant::now();
        solo.all_reduce_sum(&mut [1.0; 1000]).unwrap();
        assert!(t.elapsed() < Duration::from_millis(40));
    }
}
