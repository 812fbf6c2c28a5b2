//! The `[train]` settings that choose number formats and where state lives: the compute
//! precision, the encoding of quantized collectives, what `--offload` keeps in host memory and
//! the pipeline schedule.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The dtype of the forward/backward compute. Parameters and Adam moments are always fp32
/// (master weights); with `bf16` the matmuls, activations and their gradients are bf16 while
/// layer-norm and softmax statistics, attention, the loss and gradient reductions stay fp32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    #[default]
    Fp32,
    Bf16,
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
        })
    }
}

/// How a quantized collective encodes what it moves (ZeRO++; `parallel::quant`): `int8`,
/// block-wise with one fp32 scale per 256 values (about 1/4 of fp32's bytes), or `bf16`
/// (1/2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Quantize {
    Int8,
    Bf16,
}

impl std::fmt::Display for Quantize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Quantize::Int8 => "int8",
            Quantize::Bf16 => "bf16",
        })
    }
}

impl std::str::FromStr for Quantize {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "int8" => Ok(Quantize::Int8),
            "bf16" => Ok(Quantize::Bf16),
            _ => Err(format!("`{s}`: the quantized encodings are int8 and bf16")),
        }
    }
}

/// `quantize_weights` / `quantize_grads` in a config file: an encoding, or `fp32` for none, as
/// the flags take them (`fp32` was refused in a file: "unknown variant").
pub fn quantize_or_fp32<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Option<Quantize>, D::Error> {
    // `null` too: a checkpoint's trainer_state.json writes an unset one so.
    let Some(s) = Option::<String>::deserialize(d)? else {
        return Ok(None);
    };
    match s.as_str() {
        "fp32" => Ok(None),
        other => other.parse().map(Some).map_err(|_| {
            serde::de::Error::custom(format!("`{other}`: int8, bf16, or fp32 (unquantized)"))
        }),
    }
}

/// What lives in host memory instead of the device's (`--offload`; ZeRO-Offload and ALST):
/// `optimizer`, the Adam moments (with ZeRO-3, the rank's fp32 master shard too), updated by
/// the fused CPU AdamW; `activations`, the layer inputs `--checkpoint-activations` keeps between
/// the forward and each layer's recompute; `all`, both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Offload {
    #[default]
    None,
    Optimizer,
    Activations,
    All,
}

impl Offload {
    pub fn optimizer(self) -> bool {
        matches!(self, Offload::Optimizer | Offload::All)
    }

    pub fn activations(self) -> bool {
        matches!(self, Offload::Activations | Offload::All)
    }
}

impl std::fmt::Display for Offload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Offload::None => "none",
            Offload::Optimizer => "optimizer",
            Offload::Activations => "activations",
            Offload::All => "all",
        })
    }
}

impl std::str::FromStr for Offload {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "none" => Ok(Offload::None),
            "optimizer" => Ok(Offload::Optimizer),
            "activations" => Ok(Offload::Activations),
            "all" => Ok(Offload::All),
            _ => Err(format!(
                "`{s}`: offload none, optimizer, activations or all"
            )),
        }
    }
}

/// Pipeline schedule (`--pp-schedule`, `[train] pp_schedule`); what each one runs is
/// `parallel::pipeline::schedule`'s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScheduleKind {
    GPipe,
    OneFOneB,
    Interleaved,
    ZeroBubble,
}

impl ScheduleKind {
    pub const ALL: [ScheduleKind; 4] = [
        Self::GPipe,
        Self::OneFOneB,
        Self::Interleaved,
        Self::ZeroBubble,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::GPipe => "gpipe",
            Self::OneFOneB => "1f1b",
            Self::Interleaved => "interleaved",
            Self::ZeroBubble => "zb",
        }
    }

    /// Whether the backward is split into B (input gradient) and W (weight gradient).
    pub fn splits_backward(self) -> bool {
        self == Self::ZeroBubble
    }
}

/// `1f1b`, the schedule `--pp` uses unless told otherwise.
impl Default for ScheduleKind {
    fn default() -> Self {
        Self::OneFOneB
    }
}

/// As its name (`[train] pp_schedule = "1f1b"`).
impl serde::Serialize for ScheduleKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> serde::Deserialize<'de> for ScheduleKind {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}

impl std::fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for ScheduleKind {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "--pp-schedule {s:?}: expected one of gpipe, 1f1b, interleaved, zb"
                ))
            })
    }
}
