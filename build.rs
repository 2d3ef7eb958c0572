//! How the `dsh` binary's code is laid out when it is linked.
//!
//! A release build of `dsh` has about 35 MB of code, and the kernel maps a
//! file's pages 64 KiB around each page a process touches, so code touched
//! here and there at start-up and in an agent's step made most of a fresh
//! process's memory. `link/symbol-order.txt` names the functions those paths
//! run (`link/order.py` writes it from traces of the workloads), and the
//! linker puts them first, side by side (lld's and mold's
//! `--symbol-ordering-file`). A name the build does not have is skipped.
//!
//! `DSH_LINK_MAP=path` also writes the linker's map there (what
//! `link/order.py` reads).

use std::env;
use std::path::Path;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=link/symbol-order.txt");
    println!("cargo:rerun-if-env-changed=DSH_LINK_MAP");
    let var = |name: &str| env::var(name).unwrap_or_default();
    // rustc links x86_64 Linux with its own lld; a build that picks its own
    // linker (which may be GNU ld, without these options) keeps the default
    // layout.
    let own_linker =
        var("CARGO_ENCODED_RUSTFLAGS").contains("linker") || !var("RUSTC_LINKER").is_empty();
    if var("TARGET") != "x86_64-unknown-linux-gnu" || own_linker || var("PROFILE") != "release" {
        return;
    }
    let order = Path::new(&var("CARGO_MANIFEST_DIR")).join("link/symbol-order.txt");
    // A packaged copy without the list links in the default order.
    if order.is_file() {
        println!(
            "cargo:rustc-link-arg-bin=dsh=-Wl,--symbol-ordering-file={}",
            order.display()
        );
        println!("cargo:rustc-link-arg-bin=dsh=-Wl,--no-warn-symbol-ordering");
    }
    // The binary's relative relocations, packed (DT_RELR): about 1.8 MB of
    // `.rela.dyn` that the loader reads at every start becomes a few KB. The
    // loader must know the format (glibc 2.36 and later), so it is used only
    // where the glibc the binary is built on does.
    if glibc_at_least(2, 36) {
        println!("cargo:rustc-link-arg-bin=dsh=-Wl,-z,pack-relative-relocs");
    }
    let map = var("DSH_LINK_MAP");
    if !map.is_empty() {
        println!("cargo:rustc-link-arg-bin=dsh=-Wl,-Map={map}");
    }
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
