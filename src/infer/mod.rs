//! Inference: scoring (perplexity), embeddings (parquet), generation (FASTA).

pub mod bench;
pub mod embed;
pub mod embed_io;
pub mod generate;
pub mod parquet_sink;
pub mod sample;
pub mod score;
pub mod score_io;
pub mod token_scores;
pub mod token_states;
pub mod variants;
pub mod window;
