//! What the host's memory holds for this process, read from /proc and the cgroup: the bytes
//! it can still use (the memory checks of train, bench, ingest and inference) and its resident
//! set (the metrics). Beside every layer: data/ sizes its buffers by it as train/ does.

/// Bytes this process can still use: `MemAvailable`, bounded by a cgroup v2 limit and by an
/// address-space limit (`ulimit -v`, which some batch systems set) when there is one. `None`
/// where none can be read (the check is then skipped).
pub fn available_bytes() -> Option<f64> {
    let mut avail = proc_kib("/proc/meminfo", "MemAvailable:")? as f64 * 1024.0;
    let address_space = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|t| {
            let line = t
                .lines()
                .find_map(|l| l.strip_prefix("Max address space"))?;
            line.split_whitespace().next()?.parse::<f64>().ok()
        });
    if let (Some(limit), Some(used)) = (address_space, proc_kib("/proc/self/status", "VmSize:")) {
        avail = avail.min((limit - used as f64 * 1024.0).max(0.0));
    }
    let read = |f: &str| -> Option<f64> {
        std::fs::read_to_string(format!("/sys/fs/cgroup/{f}"))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    if let (Some(max), Some(used)) = (read("memory.max"), read("memory.current")) {
        avail = avail.min((max - used).max(0.0));
    }
    Some(avail)
}

/// Peak resident memory of this process in MiB (`VmHWM`), or 0 where unavailable.
pub fn peak_rss_mib() -> f64 {
    proc_kib("/proc/self/status", "VmHWM:").map_or(0.0, |k| k as f64 / 1024.0)
}

/// Current resident memory in MiB (`VmRSS`).
pub fn rss_mib() -> f64 {
    proc_kib("/proc/self/status", "VmRSS:").map_or(0.0, |k| k as f64 / 1024.0)
}

/// The kB value of the line starting with `key` in a /proc file (`status`, `meminfo`).
pub fn proc_kib(path: &str, key: &str) -> Option<u64> {
    let s = std::fs::read_to_string(path).ok()?;
    let line = s.lines().find(|l| l.starts_with(key))?;
    line[key.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}
