//! Learning-rate schedule: linear warm-up, then cosine decay to `min_lr_ratio · lr`.

/// lr at optimizer step `step` (0-based) of `total` steps.
///
/// Warm-up: `lr · (step + 1) / warmup` for `step < warmup`, so the first step already moves.
/// Then cosine from `lr` at `step = warmup` to `min_lr_ratio · lr` at `step = total − 1`.
pub fn lr_at(step: usize, total: usize, warmup: usize, lr: f64, min_lr_ratio: f64) -> f64 {
    if step < warmup {
        return lr * (step + 1) as f64 / warmup as f64;
    }
    let decay_steps = total.saturating_sub(warmup + 1);
    if decay_steps == 0 {
        return lr;
    }
    let progress = ((step - warmup) as f64 / decay_steps as f64).min(1.0);
    let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
    lr * (min_lr_ratio + (1.0 - min_lr_ratio) * cosine)
}

#[cfg(test)]
mod tests {
    use super::lr_at;

    #[test]
    fn warmup_then_cosine() {
        let (lr, total, warm) = (1e-3, 111, 10);
        assert!((lr_at(0, total, warm, lr, 0.1) - 1e-4).abs() < 1e-15);
        assert!((lr_at(9, total, warm, lr, 0.1) - 1e-3).abs() < 1e-15);
        assert!((lr_at(10, total, warm, lr, 0.1) - 1e-3).abs() < 1e-15);
        // 100 decay steps; halfway cos(pi/2) = 0, so the factor is 0.1 + 0.9 * 0.5 = 0.55.
        assert!((lr_at(60, total, warm, lr, 0.1) - 0.55e-3).abs() < 1e-15);
        assert!((lr_at(110, total, warm, lr, 0.1) - 1e-4).abs() < 1e-15);
        // No warm-up, one step: the full rate.
        assert_eq!(lr_at(0, 1, 0, lr, 0.1), lr);
    }
}
