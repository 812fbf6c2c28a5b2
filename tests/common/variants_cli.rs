//! `genslm variants` on a 30-codon CDS the tests write: the record, a VCF of every kind of
//! change, and the run of the command with the trained tiny model.

use super::{arg, run, trained_tiny, write};

/// A CDS of 30 codons: ATG, 28 sense codons, TAA.
pub fn cds() -> String {
    let mut s = String::from("ATG");
    for i in 0..28 {
        s.push_str(["GCT", "AAA", "CTG", "GAA", "TTC", "CGT", "TAC"][i % 7]);
    }
    s.push_str("TAA");
    s
}

pub fn fasta(dir: &std::path::Path) -> std::path::PathBuf {
    write(dir, "ref.fa", format!(">gene desc\n{}\n", cds()).as_bytes())
}

pub fn variants(args: &[&str]) -> (bool, String, String) {
    let model = arg(trained_tiny());
    let mut a = vec!["variants", "--model", &model, "--quiet"];
    a.extend_from_slice(args);
    run(&a)
}

pub fn table(path: &std::path::Path) -> Vec<Vec<String>> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| l.split('\t').map(str::to_string).collect())
        .collect()
}

pub const VCF: &str = "##fileformat=VCFv4.2\n#CHROM\tPOS\tID\tREF\tALT\n\
gene\t5\tsyn_or_mis\tC\tT\n\
gene\t1\tstart\tA\tG\n\
gene\t88\tlast\tT\tC\n\
gene\t7\tmnv\tAAA\tCCC\n\
gene\t30\tins\tA\tATTT,AT\n\
gene\t45\tdel\tCGCT\tC\n\
gene\t88\tend_del\tTAA\tT\n\
gene\t40\tlong_del\tCGTTACGCTAAACTGGAATTCC\tC\n";
