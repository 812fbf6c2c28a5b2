//! Data: FASTA reading and validation, tokenized parquet datasets, the ingest pipeline.

mod clean;
pub mod dataset;
pub mod digest;
pub mod fasta;
mod fasta_errors;
pub mod fastx_open;
pub mod ingest;
mod ingest_queue;
pub mod loader;
pub mod parquet_open;
mod token_pages;
