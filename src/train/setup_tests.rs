//! Tests of `setup.rs`.
use super::*;
use crate::parallel::topology::Degrees;

fn check(cp: usize, sp: usize, tp: usize, seq_len: usize) -> Result<()> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny.toml");
    let mut cfg = Config::load(&path).unwrap();
    cfg.train.seq_len = seq_len;
    cfg.train.batch_size = 1;
    let d = Degrees {
        dp: 1,
        cp,
        sp,
        tp,
        pp: 1,
    };
    validate_layout(&cfg, &Topology::of(0, d).unwrap())
}

/// A window cut into at least twice as many pieces as its tokens is refused with a degree
/// change that runs; fewer pieces run, ranks holding some padding (5 tokens on 4 SP ranks)
/// or only padding (6 tokens in 2·4 zigzag chunks) included.
#[test]
fn a_window_cut_finer_than_its_tokens_is_refused() {
    for (cp, sp, tp, len) in [
        (64, 1, 1, 128),
        (127, 1, 1, 128),
        (1, 4, 1, 5),
        (4, 1, 1, 6),
    ] {
        assert!(check(cp, sp, tp, len).is_ok(), "{cp} {sp} {tp} {len}");
    }
    assert!(check(1, 2, 2, 4).is_ok() && check(1, 1, 2, 3).is_ok() && check(1, 2, 1, 2).is_ok());
    let e = check(128, 1, 1, 128).unwrap_err().to_string();
    assert!(
        e.contains("256 pieces") && e.contains("(at most --cp 127 here)"),
        "{e}"
    );
    let e = check(256, 1, 1, 128).unwrap_err().to_string();
    assert!(
        e.contains("512 pieces") && e.contains("at least twice its 128 tokens"),
        "{e}"
    );
    let e = check(2, 2, 2, 8).unwrap_err().to_string();
    assert!(e.contains("16 pieces (2·cp·sp·tp = 2·2·2·2)"), "{e}");
    assert!(e.contains("(--cp 1 here)"), "{e}");
    let e = check(1, 8, 2, 5).unwrap_err().to_string();
    assert!(
        e.contains("16 pieces (sp·tp = 8·2)") && e.contains("(at most --sp 4 here)"),
        "{e}"
    );
    // Each suggestion is a layout the check takes (the degree named moves; TP divides the
    // 4 heads).
    for (cp, sp, tp, len, fix, then) in [
        (1, 1, 4, 2, "at most --tp 2", (1, 1, 2)),
        (2, 2, 2, 3, "--cp 1", (1, 2, 2)),
        (2, 4, 1, 2, "--cp 1 and at most --sp 3", (1, 3, 1)),
        (1, 4, 4, 2, "--sp 1 and at most --tp 2", (1, 1, 2)),
    ] {
        let e = check(cp, sp, tp, len).unwrap_err().to_string();
        assert!(e.contains(&format!("({fix} here)")), "{e}");
        assert!(check(then.0, then.1, then.2, len).is_ok(), "{fix}");
    }
    // Degrees whose product overflows are refused, not a panic.
    assert!(check(usize::MAX / 2, 1, 1, 128).is_err());
}
