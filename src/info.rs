//! `genslm info`: a model config's shape, parameter count and training memory.

use std::fmt::Write;
use std::path::Path;

use crate::config::{ModelConfig, Position};
use crate::error::{Error, Result};

/// Bytes as GiB with two decimals.
pub fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// Thousands separators for counts.
pub fn group_digits(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The model config `genslm info --config PATH` describes: a genslm TOML; a Hugging Face
/// `config.json` (any name ending in .json), as `convert --config` takes; or a model or run
/// directory (its `config.json`, or its latest checkpoint's).
pub fn load_model_config(path: &Path) -> Result<ModelConfig> {
    // A preset's bare name stays the preset, as in plan, train and bench (`./tiny` names the
    // directory): the same `--config tiny` read a directory here and the preset there.
    if path.is_dir() && crate::config::preset(path).is_none() {
        let dir = crate::model::io::resolve_model_dir(path)?;
        return crate::model::io::load_config(&dir);
    }
    let json = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("json"));
    if json {
        let text = crate::config::read_config_text(path)?;
        return crate::model::hf::config_from_hf(&text).map_err(|msg| Error::Config {
            file: path.to_path_buf(),
            msg,
        });
    }
    Ok(crate::config::Config::load(path)?.model)
}

/// The report `genslm info` prints.
pub fn report(m: &ModelConfig) -> String {
    let mut s = String::new();
    let p = m.param_count();
    let _ = writeln!(s, "model               {}", m.name);
    let _ = writeln!(s, "layers              {}", m.num_layers);
    let _ = writeln!(s, "hidden              {}", m.hidden_size);
    let _ = writeln!(
        s,
        "heads               {} (head dim {})",
        m.num_heads,
        m.head_dim()
    );
    let _ = writeln!(s, "intermediate        {}", m.intermediate_size);
    let _ = writeln!(s, "vocabulary          {} ({} ids)", m.vocab, m.vocab_size);
    let pos = match m.position {
        Position::Rotary => format!(
            "rotary (first {} of {} dims per head, base {})",
            m.rotary_dims(),
            m.head_dim(),
            m.rotary_base
        ),
        other => other.to_string(),
    };
    let _ = writeln!(s, "positions           {pos}");
    let _ = writeln!(s, "max positions       {}", m.max_position_embeddings);
    let _ = writeln!(s, "parameters          {} ({p})", group_digits(p));
    let _ = writeln!(s, "memory              fp32          bf16 mixed");
    let f = TrainingMemory::fp32(p);
    let b = TrainingMemory::bf16_mixed(p);
    let row = |name: &str, a: String, c: u64| format!("  {name:<18}{a:<14}{}\n", gib(c));
    s.push_str(&row("weights", gib(f.weights), b.weights));
    s.push_str(&row("gradients", gib(f.gradients), b.gradients));
    s.push_str(&row("fp32 master", "-".into(), b.master));
    s.push_str(&row("adam states (m,v)", gib(f.adam_states), b.adam_states));
    s.push_str(&row("total", gib(f.total()), b.total()));
    s.push_str(
        "  (per replica, without activations; bf16 mixed: bf16 working weights, fp32 \
         gradients, master weights and moments. ZeRO shards them, and `genslm plan` counts \
         activations, layouts and GPUs)\n",
    );
    s
}

/// Bytes of a model's training state (no activations): weights, gradients, fp32 master
/// weights (mixed precision only) and the two Adam moments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrainingMemory {
    pub weights: u64,
    pub gradients: u64,
    pub master: u64,
    pub adam_states: u64,
}

impl TrainingMemory {
    /// `--precision fp32`: everything in fp32 (4 + 4 + 8 bytes per parameter).
    pub fn fp32(params: u64) -> Self {
        Self {
            weights: 4 * params,
            gradients: 4 * params,
            master: 0,
            adam_states: 8 * params,
        }
    }

    /// `--precision bf16` as genslm's trainer keeps it (`train::master`; `plan` counts the
    /// same without ZeRO): bf16 working weights (2), gradients accumulated and reduced in fp32
    /// (4), fp32 master weights (4) and moments (8): 18 bytes per parameter, more than fp32's
    /// 16 — mixed precision saves activation memory and compute, not state.
    pub fn bf16_mixed(params: u64) -> Self {
        Self {
            weights: 2 * params,
            gradients: 4 * params,
            master: 4 * params,
            adam_states: 8 * params,
        }
    }

    pub fn total(&self) -> u64 {
        self.weights + self.gradients + self.master + self.adam_states
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn digits() {
        assert_eq!(super::group_digits(25_290_752), "25,290,752");
        assert_eq!(super::group_digits(999), "999");
        assert_eq!(super::group_digits(1000), "1,000");
    }
}
