//! Inference: scoring (perplexity) now; embeddings and generation join later.

pub mod score;
