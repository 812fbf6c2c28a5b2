//! The formula of every memory term, per rank, in bytes (notation in [`super`]).

use super::counts::layer_params;
use super::state_terms::{
    grads_at_peak, has_optimizer, offloaded_inputs, offloaded_state, states, view,
};
use super::{cpu, Breakdown, Checkpointing, Hardware, Mask, Recipe, Strategy, Target, GIB};
use crate::config::{AttentionKind, ModelConfig, Position};

/// What one layer keeps, per token (bytes) unless said otherwise.
struct LayerTerms {
    /// Sequence region (split over `seq_shard`).
    seq: f64,
    /// Head region (split over `head_shard`).
    head: f64,
    /// Naive attention: bytes per (query, key, head), head region.
    scores: f64,
    /// Naive attention: one buffer for the scores shared by all layers, bytes per (query, key,
    /// head), head region.
    buffer: f64,
    /// Naive attention: a causal mask built by each layer, bytes per (query, key), not split.
    layer_mask: f64,
    /// Flash attention: the row log-sum-exp, bytes per (token, head).
    lse: f64,
    /// Backward working gradients of one layer: head region, sequence region, and per
    /// (query, key, head) for naive attention.
    work_head: f64,
    work_seq: f64,
    work_scores: f64,
}

/// Elements per token one layer keeps in `h`-wide tensors (all it keeps but the MLP's two
/// `i`-wide ones), for the CPU model's allocator retention.
fn narrow_elements(m: &ModelConfig, st: &Strategy) -> f64 {
    let lt = layer_terms(m, st);
    let e = st.precision.activation_bytes();
    (lt.seq + lt.head) / e - 2.0 * m.intermediate_size as f64
}

fn layer_terms(m: &ModelConfig, st: &Strategy) -> LayerTerms {
    let e = st.precision.activation_bytes();
    let (h, i) = (m.hidden_size as f64, m.intermediate_size as f64);
    let naive = st.attention == AttentionKind::Naive;
    match st.recipe {
        Recipe::Megatron {
            dropout,
            softmax_fp32,
            score_buffer,
        } => {
            let drop = if dropout { 1.0 } else { 0.0 };
            // Bytes per score of the probabilities softmax keeps for its backward.
            let probs = if softmax_fp32 { 4.0 } else { e };
            LayerTerms {
                // Inputs of LN1, of the QKV projection, of LN2 and of the MLP (e·h each), and
                // the two 1-byte dropout masks after attention and after the MLP:
                // 10·h for e = 2 with dropout (Korthikanti et al., eq. 1).
                seq: 4.0 * e * h + 2.0 * drop * h,
                // Q, K, V and the attention output (e·h each), the MLP's fc1 output (GeLU
                // input) and GeLU output (e·i each): 24·h for e = 2 and i = 4h.
                head: 4.0 * e * h + 2.0 * e * i,
                // Softmax output (e, or 4 in fp32), dropout mask (1) and dropout output (e):
                // 5 bytes per score with dropout in 16-bit, the `5·a·s/h` term.
                scores: if naive { probs + drop * (1.0 + e) } else { 0.0 },
                buffer: if naive && score_buffer { e } else { 0.0 },
                layer_mask: 0.0,
                lse: if naive { 0.0 } else { 4.0 },
                // Gradients of the MLP's two i-wide tensors and of the layer's input/output.
                work_head: 2.0 * e * i,
                work_seq: 2.0 * e * h,
                // Softmax's backward (PyTorch's `tmp = grad * output`, then the input
                // gradient): the incoming gradient, the product and the result in the
                // softmax's precision, beside the kept probabilities. Dropout's tensors are
                // freed by then; its mask and output are replaced by these.
                work_scores: if naive {
                    3.0 * probs - drop * (1.0 + e)
                } else {
                    0.0
                },
            }
        }
        Recipe::Genslm => {
            // One rank's whole sequence with rotary FlashAttention runs the fused QKV
            // attention op (ops::attention::qkv): it keeps the fp32 QKV projection (3h) and
            // its fp32 output, which is the dense matmul's input in fp32 (counted below) and a
            // tensor of its own under 16-bit compute. Otherwise Q, K, V as flash attention
            // keeps them and its output O: 4h. Without Ulysses exchanges, V is a view of the
            // fused QKV output, which keeps all 3h of it alive; with rotary, Q and K are new
            // tensors (rotate-half and cat), otherwise views too.
            let fused = st.layout.sp == 1
                && st.layout.cp == 1
                && st.positions == Position::Rotary
                && !naive;
            let qkvo_bytes = if fused {
                4.0 * (3.0 * h + if e == 4.0 { 0.0 } else { h })
            } else if st.layout.sp == 1 && st.positions == Position::Rotary {
                6.0 * h * e
            } else {
                4.0 * h * e
            };
            // The fused LayerNorm keeps its fp32 input: the layer's input, one tensor for LN1
            // and LN2 in fp32, one fp32 copy each under 16-bit compute.
            let ln_inputs = if e == 4.0 { 4.0 * h } else { 2.0 * 4.0 * h };
            LayerTerms {
                // The LayerNorms' inputs; LN1's output (the QKV matmul's input); the attention
                // output reshaped for the dense matmul; LN2's output (fc1's input): 4·h
                // elements in fp32.
                seq: ln_inputs + 3.0 * e * h,
                // fc1 output (the fused gelu_fast keeps only its input) and gelu's output
                // (fc2's input): 2·i elements; with the fused attention's 3h, 11·h for i = 4h.
                head: qkvo_bytes + 2.0 * e * i,
                // softmax keeps exp(x − max) and the probabilities (the matmul with V).
                scores: if naive { 2.0 * e } else { 0.0 },
                buffer: 0.0,
                // Each naive call builds a bool [1, 1, s, s] causal mask that mask_fill keeps.
                layer_mask: if naive { 1.0 } else { 0.0 },
                lse: if naive { 0.0 } else { 4.0 },
                // gelu_fast's backward: the gradient arriving and the one it returns, i wide.
                work_head: 2.0 * e * i,
                work_seq: 0.0,
                // Scores, masked scores and softmax temporaries of one layer.
                work_scores: if naive { 3.0 * e } else { 0.0 },
            }
        }
    }
}

/// Bytes per token of the final LayerNorm and LM-head input (sequence region) and bytes per
/// (token, vocabulary entry) of the logits and loss (head region).
fn head_terms(m: &ModelConfig, st: &Strategy) -> (f64, f64) {
    let e = st.precision.activation_bytes();
    let h = m.hidden_size as f64;
    match st.recipe {
        // Final LN input and LM-head input (e·h each); logits (e), their fp32 copy in the
        // vocab-parallel cross entropy whose softmax is kept (4), its fp32 gradient (4).
        Recipe::Megatron { .. } => (2.0 * e * h, e + 8.0),
        // Final LN: its fp32 input and its output (embed_out's input); log_softmax keeps
        // exp(x − max) and the logits and the log-probabilities' gradient are live when the
        // backward starts: 3 vocabulary-wide tensors.
        Recipe::Genslm => ((4.0 + e) * h, 3.0 * e),
    }
}

/// Under PP, the activation received from the previous stage and the gradient from the next,
/// as genslm stages them (fp32 host copies): 2·4·h bytes per token of the rank's shard.
fn pipeline_buffers(m: &ModelConfig, st: &Strategy, tokens: f64) -> f64 {
    if st.layout.pp <= 1 {
        return 0.0;
    }
    2.0 * 4.0 * m.hidden_size as f64 * tokens / st.layout.seq_shard() as f64
}

/// Token ids and targets (i64) and loss weights (f32), per token.
const TOKEN_BYTES: f64 = 20.0;

/// Fixed reserve on a GPU: CUDA context with cuBLAS/NCCL workspaces (1 GiB) and 5% of the
/// device for the caching allocator's fragmentation.
pub fn gpu_reserve(mem_bytes: f64) -> f64 {
    GIB + 0.05 * mem_bytes
}

fn fixed_workspace(hw: &Hardware) -> f64 {
    match hw.target {
        Target::Gpu => gpu_reserve(hw.mem_bytes),
        Target::Cpu { run } => cpu::baseline(run),
    }
}

/// Under full checkpointing, the inputs every layer keeps: `L·b·s·e·h`, split over `t·p` with
/// Megatron SP or partitioned checkpoints, over the Ulysses ranks `p` only otherwise (plain TP
/// keeps the whole input on every TP rank).
/// Device-resident: none when they are offloaded (one comes back at a time, counted with the
/// recomputed layer).
pub(super) fn kept_layer_inputs(
    m: &ModelConfig,
    st: &Strategy,
    hw: &Hardware,
    seq_len: usize,
) -> f64 {
    if offloaded_inputs(st, hw) {
        return 0.0;
    }
    all_kept_inputs(m, st, seq_len)
}

/// [`kept_layer_inputs`] wherever they live.
fn all_kept_inputs(m: &ModelConfig, st: &Strategy, seq_len: usize) -> f64 {
    let l = &st.layout;
    let partitioned = matches!(st.checkpointing, Checkpointing::Full { partitioned: true });
    // Partitioned checkpoints are split over all the ranks of the TP × Ulysses group
    // (DeepSpeed's `partition_activations` scatters each kept input over the TP ranks).
    let kept_shard = if l.megatron_sp || partitioned {
        l.head_shard()
    } else {
        l.sp * l.cp
    };
    let tokens = (st.batch_size * seq_len) as f64;
    view(m, st).kept_layers as f64 * tokens * st.precision.activation_bytes() * m.hidden_size as f64
        / kept_shard as f64
}

/// The tensors of the final LayerNorm, the LM head and the loss (activations, logits): the
/// sequence-region inputs with the token ids, and the logits with their loss tensors
/// (vocabulary split over `t`, tokens over `p·c`).
fn loss_tensors(m: &ModelConfig, st: &Strategy, seq_len: usize) -> (f64, f64) {
    let l = &st.layout;
    let tokens = (st.batch_size * seq_len) as f64;
    if !view(m, st).head {
        // Only the last pipeline stage runs the head and the loss.
        return (tokens * token_tables(m, st) / l.seq_shard() as f64, 0.0);
    }
    let (head_seq, logit_bytes) = head_terms(m, st);
    let acts = tokens * (head_seq + token_tables(m, st)) / l.seq_shard() as f64;
    let logits = tokens * st.vocab_size as f64 * logit_bytes / (l.tp * l.sp * l.cp) as f64;
    (acts, logits)
}

/// Bytes per token of what every layer reads for the whole step: the token ids, targets and
/// loss weights, and genslm's rotary cos/sin tables (2·r fp32).
fn token_tables(m: &ModelConfig, st: &Strategy) -> f64 {
    let rotary = if st.recipe == Recipe::Genslm && st.positions == Position::Rotary {
        8.0 * m.rotary_dims() as f64
    } else {
        0.0
    };
    TOKEN_BYTES + rotary
}

/// Megatron-LM's global score buffer (naive attention): allocated by the first layer's
/// forward and kept for the run, one for all layers.
fn score_buffer(m: &ModelConfig, st: &Strategy, seq_len: usize) -> f64 {
    let s = seq_len as f64;
    let tokens = st.batch_size as f64 * s;
    tokens * s * m.num_heads as f64 * layer_terms(m, st).buffer / st.layout.head_shard() as f64
}

/// A materialised mask: one bool `[s, s]` on every rank.
fn materialised_mask(st: &Strategy, s: f64) -> f64 {
    if st.mask == Mask::Materialised {
        s * s
    } else {
        0.0
    }
}

/// The loss under full checkpointing: every layer's kept input, the final LayerNorm, the
/// logits and the loss' tensors, and the LM head's all-gathered input with Megatron SP.
pub(super) fn loss(m: &ModelConfig, st: &Strategy, hw: &Hardware, seq_len: usize) -> Breakdown {
    let l = &st.layout;
    let s = seq_len as f64;
    let tokens = st.batch_size as f64 * s;
    let (parameters, gradients, optimizer_states, position_table) =
        states(m, st, hw, s, grads_at_peak(st));
    let (head_acts, logits) = loss_tensors(m, st, seq_len);
    let communication = match hw.target {
        Target::Gpu => {
            let mut c = 0.0;
            if l.megatron_sp && l.tp > 1 {
                // The LM head is column-parallel: its input is all-gathered over the TP ranks.
                c += st.precision.activation_bytes() * m.hidden_size as f64 * tokens
                    / (l.sp * l.cp) as f64;
            }
            if l.zero >= 3 {
                // ZeRO-3 gathers the LM head's weight (V·h/t).
                c += st.precision.state_bytes().0 * (st.vocab_size * m.hidden_size) as f64
                    / l.tp as f64;
            }
            c
        }
        Target::Cpu { .. } => 0.0,
    };
    Breakdown {
        parameters,
        gradients,
        optimizer_states,
        activations: kept_layer_inputs(m, st, hw, seq_len) + head_acts,
        attention: score_buffer(m, st, seq_len) + materialised_mask(st, s),
        position_table,
        logits,
        communication,
        workspace: fixed_workspace(hw),
    }
}

/// The forward/backward peak: every saved activation live, the backward about to start.
pub(super) fn forward_backward(
    m: &ModelConfig,
    st: &Strategy,
    hw: &Hardware,
    seq_len: usize,
) -> Breakdown {
    let l = &st.layout;
    let e = st.precision.activation_bytes();
    let (s, b) = (seq_len as f64, st.batch_size as f64);
    let (h, a) = (m.hidden_size as f64, m.num_heads as f64);
    // Layers whose activations are kept: all of them, or under PP the stage's in flight.
    let layers = view(m, st).kept_layers as f64;
    let tokens = b * s;
    let (seq_shard, head_shard) = (l.seq_shard() as f64, l.head_shard() as f64);
    let (p, t, cp) = (l.sp as f64, l.tp as f64, l.cp as f64);
    let (parameters, gradients, optimizer_states, position_table) =
        states(m, st, hw, s, grads_at_peak(st));

    let lt = layer_terms(m, st);
    // One layer: tokens·(seq/seq_shard + head/head_shard).
    let one_layer = tokens * (lt.seq / seq_shard + lt.head / head_shard);
    // Attention of one layer: naive scores b·s·s·a·scores/head_shard plus the layer's own mask
    // s²·layer_mask; flash's log-sum-exp b·s·a·4/head_shard.
    let one_attention = tokens * s * a * lt.scores / head_shard
        + s * s * lt.layer_mask
        + tokens * a * lt.lse / head_shard;
    let checkpointed = matches!(st.checkpointing, Checkpointing::Full { .. });
    let (layer_acts, layer_attention) = if checkpointed {
        // Each layer keeps its input and one layer at a time is recomputed in full (its
        // input is the kept one, counted in `one_layer`).
        (
            kept_layer_inputs(m, st, hw, seq_len) * (layers - 1.0) / layers + one_layer,
            one_attention,
        )
    } else {
        (layers * one_layer, layers * one_attention)
    };
    // Without checkpointing the loss' tensors are still live when the last layer's backward
    // starts. With it, the LM head's backward has freed them before the first layer is
    // recomputed: they peak in their own phase ([`loss`]).
    let (head_acts, logits) = if checkpointed {
        (tokens * token_tables(m, st) / seq_shard, 0.0)
    } else {
        loss_tensors(m, st, seq_len)
    };
    let activations = layer_acts + head_acts;
    let attention = layer_attention + score_buffer(m, st, seq_len) + materialised_mask(st, s);

    let communication = match hw.target {
        Target::Gpu => {
            let mut c = 0.0;
            if l.megatron_sp && l.tp > 1 {
                // The all-gathered [s/p, b, h] input of a column-parallel matmul and the
                // [s/p, b, h] partial output a row-parallel matmul reduce-scatters: 2·e·h per
                // token of the Ulysses shard, not split over t.
                c += 2.0 * e * h * tokens / (p * cp);
            }
            if l.sp > 1 {
                // One Ulysses exchange in flight: send and receive buffers of Q, K and V.
                c += 2.0 * 3.0 * e * h * tokens / (p * cp);
            }
            if l.cp > 1 {
                // The ring's blocks (s/c tokens of a/(p·t) heads): K and V sent and received,
                // in the backward with their fp32 dK/dV accumulators, and the fp32 output
                // accumulator the log-sum-exp merge updates.
                c += (2.0 * (2.0 * e + 2.0 * 4.0) + 4.0) * h * tokens / head_shard;
            }
            if l.zero >= 3 {
                // ZeRO-3 gathers the weights of the running layer and prefetches the next.
                c += 2.0 * st.precision.state_bytes().0 * layer_params(m) / t;
            }
            c + pipeline_buffers(m, st, tokens)
        }
        // genslm's exchanges go through host buffers during the forward; they are freed
        // before the backward starts. ZeRO-3's gathered weights are not.
        Target::Cpu { .. } => {
            cpu::gathered_weights(m, st, checkpointed) + pipeline_buffers(m, st, tokens)
        }
    };
    // genslm's checkpointed backward (src/train/recompute.rs) applies the gradient `g` of a
    // recomputed layer's output through the surrogate `Σ out ⊙ g`: `g`, the product and the
    // input's gradient are three more h-wide tensors beside the layer's graph.
    let surrogate = if checkpointed && st.recipe == Recipe::Genslm {
        tokens * 3.0 * e * h / seq_shard
    } else {
        0.0
    };
    let workspace = tokens * (lt.work_head / head_shard + lt.work_seq / seq_shard)
        + tokens * s * a * lt.work_scores / head_shard
        + surrogate
        + fixed_workspace(hw);
    Breakdown {
        parameters,
        gradients,
        optimizer_states,
        activations,
        attention,
        position_table,
        logits,
        communication,
        workspace,
    }
}

/// Building a materialised mask before the forward: the model states and the mask creation's
/// fp32 `ones(s, s)` (4·s²) and its `tril` (4·s²); the bool comparison comes after `ones` is
/// freed (4·s² + s²).
pub(super) fn mask_creation(
    m: &ModelConfig,
    st: &Strategy,
    hw: &Hardware,
    seq_len: usize,
) -> Breakdown {
    let s = seq_len as f64;
    let (parameters, gradients, optimizer_states, position_table) =
        states(m, st, hw, s, grads_at_peak(st));
    Breakdown {
        parameters,
        gradients,
        optimizer_states,
        position_table,
        attention: 8.0 * s * s,
        workspace: fixed_workspace(hw),
        ..Default::default()
    }
}

/// The optimizer step: all gradients exist; gradient reductions and the AdamW update's new
/// moments and weights (of one parameter tensor at a time) are added. On a CPU process the
/// allocator keeps the share of the activation memory the backward freed that was held in
/// small tensors ([`cpu::retained_share`]): that share of the process stays at the
/// forward/backward level with the step's buffers on top, the rest is returned.
pub(super) fn optimizer_step(
    m: &ModelConfig,
    st: &Strategy,
    hw: &Hardware,
    seq_len: usize,
    fb: &Breakdown,
) -> Breakdown {
    let s = seq_len as f64;
    let (parameters, gradients, optimizer_states, position_table) = states(m, st, hw, s, true);
    let (h, i, v) = (
        m.hidden_size as f64,
        m.intermediate_size as f64,
        st.vocab_size as f64,
    );
    let largest = (v * h).max(h * i).max(3.0 * h * h) / st.layout.tp as f64;
    // AdamW's temporaries for the largest parameter: three full-size ones as composed tensor
    // ops (CubeCL); none on CPU, where one fused pass updates the moments in place and writes
    // only the new values (`train::optim_cpu`).
    // Offloaded, the fused CPU update runs on the host and the new values of one tensor come
    // back at a time.
    let adam = match (
        has_optimizer(hw) && hw.target == Target::Gpu,
        offloaded_state(st, hw),
    ) {
        (true, (true, _)) => 4.0 * largest,
        (true, (false, _)) => 3.0 * 4.0 * largest,
        (false, _) => 0.0,
    };
    let (communication, retained) = match hw.target {
        Target::Gpu => (0.0, 0.0),
        Target::Cpu { .. } => (
            cpu::step_buffers(m, st, seq_len),
            cpu::retained_share(m, st, seq_len, narrow_elements(m, st)),
        ),
    };
    let returned = Breakdown {
        parameters,
        gradients,
        optimizer_states,
        position_table,
        communication,
        workspace: fixed_workspace(hw) + adam,
        ..Default::default()
    };
    // Resident: the forward/backward peak (gradients were allocated inside it).
    let kept = Breakdown {
        communication: fb.communication + communication,
        workspace: fb.workspace + adam,
        ..*fb
    };
    returned.mix(&kept, retained)
}
