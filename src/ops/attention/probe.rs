//! Test probes of the tiled and CPU FlashAttention paths: per-thread counters of the largest
//! score tile formed and of the forward/backward calls, which the tests read to prove that no
//! `seq × seq` tensor exists and that the fused path (not a fallback) ran.

/// Per-thread counters of what the tiled CPU path did, for tests: the largest score tile
/// (rows × columns) it formed and how many times the forward and backward ran.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TileStats {
    pub max_tile_rows: usize,
    pub max_tile_cols: usize,
    pub forward_calls: usize,
    pub backward_calls: usize,
}

thread_local! {
    static STATS: std::cell::Cell<TileStats> = const {
        std::cell::Cell::new(TileStats {
            max_tile_rows: 0,
            max_tile_cols: 0,
            forward_calls: 0,
            backward_calls: 0,
        })
    };
}

/// This thread's counters since the last [`reset_tile_stats`].
pub fn tile_stats() -> TileStats {
    STATS.with(|s| s.get())
}

pub fn reset_tile_stats() {
    STATS.with(|s| s.set(TileStats::default()));
}

pub(crate) fn record(f: impl FnOnce(&mut TileStats)) {
    STATS.with(|s| {
        let mut v = s.get();
        f(&mut v);
        s.set(v);
    });
}
