//! Tests of `atomic.rs`.
use super::*;

/// Text outputs named as another known format are refused; their own names and unknown
/// extensions pass.
#[test]
fn a_text_output_named_as_another_format_is_refused() {
    let fasta = ["fa", "fasta", "fna", "txt"];
    for bad in [
        "x.parquet",
        "x.PNG",
        "x.json",
        "x.vcf",
        "x.gz",
        "x.csv",
        "x.fastq",
        "x.fq",
    ] {
        let e = check_text_name("--out", Path::new(bad), "FASTA", &fasta).unwrap_err();
        assert!(e.to_string().contains("written as FASTA"), "{bad}: {e}");
    }
    for good in ["x.fa", "x.FASTA", "x", "x.seqs", "dir.v2/x"] {
        check_text_name("--out", Path::new(good), "FASTA", &fasta).unwrap();
    }
    let table = ["tsv", "txt", "tab", "parquet"];
    check_text_name("--out", Path::new("v.parquet"), "TSV", &table).unwrap();
    assert!(check_text_name("--out", Path::new("v.csv"), "TSV", &table).is_err());
}

/// A directory output spelled through `.` or `..`, or as `-` (stdout), is refused; names that
/// hold dots or dashes pass.
#[test]
fn a_directory_output_through_dots_is_refused() {
    for bad in [".", "..", "x/.", "x/..", "x/./", "/a/b/../", "-"] {
        assert!(check_dir_name("--out", Path::new(bad)).is_err(), "{bad}");
    }
    for good in ["x", "x/", "./x", "../x", "x/.y", "x..", "./-", "-x"] {
        check_dir_name("--out", Path::new(good)).unwrap();
    }
}

/// An output spelled as a directory is refused by name (the rename onto `x.tsv/` failed
/// with a bare "Not a directory"); file names pass.
#[test]
fn an_output_spelled_as_a_directory_is_refused() {
    for bad in ["x.tsv/", "d/x.parquet/", "x/.", ".", "..", "d/.."] {
        let e = check_names_a_file(Path::new(bad)).unwrap_err().to_string();
        assert!(e.contains("names a directory"), "{bad}: {e}");
    }
    for good in ["x.tsv", "d/x", "./x", "../x", "d/.x"] {
        check_names_a_file(Path::new(good)).unwrap();
    }
}

/// An output that is an input is refused under another spelling of its path and through a
/// link, when the writer starts and, for an input opened after it started, at the commit;
/// the input keeps its bytes.
#[cfg(unix)]
#[test]
fn an_input_is_never_written_over() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("genome.fa");
    std::fs::write(&input, b">a\nATG\n").unwrap();
    let (early, file) = AtomicFile::create(&input).unwrap();
    note_input(&dir.path().join(".").join("genome.fa"));
    let err = early.commit(file).unwrap_err().to_string();
    assert!(err.contains("an input of this command"), "{err}");
    let link = dir.path().join("link.fa");
    std::os::unix::fs::symlink(&input, &link).unwrap();
    let err = AtomicFile::create(&link).unwrap_err().to_string();
    assert!(
        err.contains("genome.fa") && err.contains("nothing was written"),
        "{err}"
    );
    assert_eq!(std::fs::read(&input).unwrap(), b">a\nATG\n");
    // Other files in the same directory are written as ever.
    write_bytes(&dir.path().join("out.tsv"), b"x").unwrap();
    assert!(dir.path().join("out.tsv").is_file());
    let leftovers = std::fs::read_dir(dir.path()).unwrap().flatten();
    assert!(
        leftovers
            .filter(|e| e.file_name().to_string_lossy().contains(".tmp-"))
            .count()
            == 0
    );
}

/// A target that exists as a socket (as a device or a named pipe would) or a directory is
/// refused and left as it was (`--out /dev/full` replaced the device with the output).
#[cfg(unix)]
#[test]
fn only_a_file_is_replaced() {
    use std::os::unix::fs::FileTypeExt;
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("sock");
    let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let err = write_bytes(&socket, b"x").unwrap_err().to_string();
    assert!(
        err.contains("not a file") && err.contains("Nothing was written"),
        "{err}"
    );
    assert!(std::fs::symlink_metadata(&socket)
        .unwrap()
        .file_type()
        .is_socket());
    let sub = dir.path().join("sub");
    std::fs::create_dir(&sub).unwrap();
    let err = write_bytes(&sub, b"x").unwrap_err().to_string();
    assert!(err.contains("is a directory"), "{err}");
    assert!(sub.is_dir());
    // A file and a link are replaced as ever (the link by the new file, its target kept).
    let file = dir.path().join("f");
    std::fs::write(&file, b"old").unwrap();
    write_bytes(&file, b"new").unwrap();
    assert_eq!(std::fs::read(&file).unwrap(), b"new");
    let link = dir.path().join("l");
    std::os::unix::fs::symlink(&file, &link).unwrap();
    write_bytes(&link, b"via").unwrap();
    assert_eq!(std::fs::read(&link).unwrap(), b"via");
    assert_eq!(std::fs::read(&file).unwrap(), b"new");
    // A link to something that is not a file is refused like it (`/dev/stdout`).
    let to_socket = dir.path().join("to_sock");
    std::os::unix::fs::symlink(&socket, &to_socket).unwrap();
    assert!(write_bytes(&to_socket, b"x").is_err());
    assert!(std::fs::symlink_metadata(&to_socket)
        .unwrap()
        .file_type()
        .is_symlink());
    let tmp = std::fs::read_dir(dir.path()).unwrap().flatten();
    assert!(
        tmp.filter(|e| e.file_name().to_string_lossy().contains(".tmp-"))
            .count()
            == 0
    );
}

#[test]
fn a_live_writer_is_refused_and_a_dead_ones_leftovers_removed() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("data.parquet");
    // A writer that died (nothing holds its lock), a live one (this test holds it), and a
    // user's file that only looks alike: only the first goes.
    let dead = dir.path().join(".data.parquet.tmp-999999991");
    let live = dir.path().join(".data.parquet.tmp-999999992");
    let other = dir.path().join(".data.parquet.tmp-notes");
    for p in [&dead, &live, &other] {
        std::fs::write(p, b"x").unwrap();
    }
    let holder = File::open(&live).unwrap();
    holder.try_lock().unwrap();
    let e = AtomicFile::create(&target).unwrap_err().to_string();
    assert!(
        e.contains("process 999999992") && e.contains("data.parquet"),
        "{e}"
    );
    assert!(!dead.exists(), "the dead writer's file is removed");
    assert!(live.exists() && other.exists());
    let ours = dir
        .path()
        .join(format!(".data.parquet.tmp-{}", std::process::id()));
    assert!(!ours.exists(), "a refused writer leaves nothing");
    assert!(!target.exists());
    // Once the live writer is gone, its leftovers go too and the write goes through.
    drop(holder);
    write_bytes(&target, b"new").unwrap();
    assert_eq!(std::fs::read(&target).unwrap(), b"new");
    assert!(!live.exists() && other.exists());
}

/// An output name of 240–255 bytes (valid) is written: its temporary carries the first bytes of
/// it (multi-byte characters kept whole) and a hash of all of it, as the directory writer's
/// lock does.
#[test]
fn a_long_output_name_is_written() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["x".repeat(250), "€".repeat(85), "é".repeat(127)] {
        let target = dir.path().join(&name);
        write_bytes(&target, b"data").unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"data");
        let stem = temp_stem(std::ffi::OsStr::new(&name));
        let kept = stem.split('~').next().unwrap();
        assert!(stem.len() <= 200 && name.starts_with(kept), "{stem}");
    }
    assert_eq!(temp_stem(std::ffi::OsStr::new("out.tsv")), "out.tsv");
    // Two long names with the same start have different temporaries.
    let (a, b) = ("g".repeat(210) + "A", "g".repeat(210) + "B");
    assert_ne!(temp_stem(a.as_ref()), temp_stem(b.as_ref()));
}
