//! How the release `dsh` binary is linked.
//!
//! A release build of `dsh` has about 35 MB of code, and the kernel maps a
//! file's pages 64 KiB around each page a process touches, so code touched
//! here and there at start-up and in an agent's step made most of a fresh
//! process's memory. `link/symbol-order.txt` names the functions those paths
//! run (`link/regen.sh` writes it from traces of the workloads), and the
//! linker puts them first, side by side (lld's `--symbol-ordering-file`).
//! A name the build does not have is skipped. The relative relocations are
//! packed as well (`-z pack-relative-relocs`).
//!
//! Each option is used only when a trial link with this build's compiler,
//! flags and linker accepts it: rustup's toolchains link x86_64 Linux with
//! their own lld, a distribution's may use GNU ld, which has no ordering
//! option. `DSH_LINK_DEFAULT=1` turns both off (a binary meant for a glibc
//! older than 2.36 must not have packed relocations). `DSH_LINK_MAP=path`
//! writes the linker's map there (what `link/order.py` reads).

use std::env;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn main() {
    println!("cargo:rerun-if-env-changed=DSH_LINK_MAP");
    println!("cargo:rerun-if-env-changed=DSH_LINK_DEFAULT");
    let var = |name: &str| env::var(name).unwrap_or_default();
    let order = Path::new(&var("CARGO_MANIFEST_DIR")).join("link/symbol-order.txt");
    // Cargo reruns a script whose named file is missing at every build.
    if order.is_file() {
        println!("cargo:rerun-if-changed=link/symbol-order.txt");
    } else {
        println!("cargo:rerun-if-changed=build.rs");
    }
    if var("TARGET") != "x86_64-unknown-linux-gnu"
        || var("PROFILE") != "release"
        || !var("DSH_LINK_DEFAULT").is_empty()
    {
        return;
    }
    let out = PathBuf::from(var("OUT_DIR"));
    // A packaged copy without the list links in the default order.
    let ordering = [
        format!("--symbol-ordering-file={}", order.display()),
        "--no-warn-symbol-ordering".to_owned(),
    ];
    if order.is_file() && links(&out, &ordering) {
        link_args(&ordering);
    }
    // The loader must know packed relocations (glibc 2.36 and later), so
    // they are used only where the glibc the binary is built on does.
    let packed = ["-z".to_owned(), "pack-relative-relocs".to_owned()];
    if glibc_at_least(2, 36) && links(&out, &packed) {
        link_args(&packed);
    }
    let map = var("DSH_LINK_MAP");
    if !map.is_empty() {
        link_args(&[format!("-Map={map}")]);
    }
}

/// Passes each option to the linker as it is (`-Xlinker`, so a comma in a
/// path stays a comma).
fn link_args(options: &[String]) {
    for option in options {
        println!("cargo:rustc-link-arg-bin=dsh=-Xlinker");
        println!("cargo:rustc-link-arg-bin=dsh={option}");
    }
}

/// Whether an empty program links with these linker options, with this
/// build's compiler, flags and linker (in `dir`).
fn links(dir: &Path, options: &[String]) -> bool {
    let source = dir.join("probe.rs");
    if std::fs::write(&source, "fn main() {}\n").is_err() {
        return false;
    }
    let mut cmd = Command::new(env::var("RUSTC").unwrap_or_else(|_| "rustc".to_owned()));
    cmd.arg("--target")
        .arg(env::var("TARGET").unwrap_or_default())
        .arg("--crate-name=dsh_link_probe")
        .arg("-o")
        .arg(dir.join("dsh-link-probe"))
        .arg(&source);
    if let Ok(flags) = env::var("CARGO_ENCODED_RUSTFLAGS") {
        cmd.args(flags.split('\x1f').filter(|f| !f.is_empty()));
    }
    if let Ok(linker) = env::var("RUSTC_LINKER") {
        cmd.arg(format!("-Clinker={linker}"));
    }
    for option in options {
        cmd.arg("-Clink-arg=-Xlinker")
            .arg(format!("-Clink-arg={option}"));
    }
    cmd.stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Whether this machine's glibc (`getconf GNU_LIBC_VERSION`, "glibc 2.36")
/// is at least `major.minor`; not when it cannot tell.
fn glibc_at_least(major: u32, minor: u32) -> bool {
    let Ok(out) = Command::new("getconf").arg("GNU_LIBC_VERSION").output() else {
        return false;
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let mut parts = text
        .trim()
        .trim_start_matches("glibc ")
        .split('.')
        .map(|p| p.parse::<u32>().ok());
    match (parts.next().flatten(), parts.next().flatten()) {
        (Some(a), Some(b)) => (a, b) >= (major, minor),
        _ => false,
    }
}
