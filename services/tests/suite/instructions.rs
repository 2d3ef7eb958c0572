//! Project instructions found on disk, as hostile as a cloned repository
//! can make them.

use std::path::Path;

use dsh_services::instructions::{MAX_TOTAL_BYTES, Source, load, render, sources};
use dsh_supervisors::scratch::fresh_dir;

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

fn texts(found: &[Source]) -> Vec<&str> {
    found.iter().map(|s| s.text.as_str()).collect()
}

/// The user's own file first, then the project root (the nearest `.git`)
/// down to the working directory; a directory's `CLAUDE.md` saying what its
/// `AGENTS.md` says is loaded once; nothing above the root.
#[test]
fn instructions_run_from_the_user_and_the_project_root_down_to_the_cwd() {
    let base = fresh_dir("dsh-instr").unwrap().canonicalize().unwrap();
    let home = base.join("home");
    let repo = base.join("repo");
    write(&base.join("AGENTS.md"), "above the project: never loaded");
    write(&home.join("AGENTS.md"), "mine, everywhere");
    std::fs::create_dir_all(repo.join(".git")).unwrap();
    write(&repo.join("AGENTS.md"), "  root rules \n");
    write(&repo.join("sub/AGENTS.md"), "sub rules");
    write(&repo.join("sub/CLAUDE.md"), "sub rules\n");
    write(&repo.join("sub/deeper/CLAUDE.md"), "deeper, for Claude");
    let cwd = repo.join("sub/deeper");
    let found = sources(&cwd, Some(&home));
    assert_eq!(
        texts(&found),
        [
            "mine, everywhere",
            "root rules",
            "sub rules",
            "deeper, for Claude"
        ]
    );
    assert_eq!(found[2].path, repo.join("sub/AGENTS.md"));
    let section = load(&cwd, Some(&home)).unwrap();
    assert!(section.starts_with("# Project instructions\n"), "{section}");
    let at = |s: &str| section.find(s).unwrap();
    assert!(at("root rules") < at("sub rules") && at("sub rules") < at("deeper"));
    assert!(
        section.contains(&format!("## From {}", repo.join("AGENTS.md").display())),
        "{section}"
    );
    // Outside any repository: the working directory alone.
    let plain = base.join("plain");
    write(&plain.join("AGENTS.md"), "plain rules");
    assert_eq!(texts(&sources(&plain, None)), ["plain rules"]);
    assert_eq!(load(&base.join("nowhere"), None), None);
}

/// A symlinked `AGENTS.md` (to a secret outside), a FIFO, a file over the
/// per-file cap and one that is not UTF-8 are all left out, and loading
/// neither blocks nor fails; what is over the total budget is named only.
#[test]
fn hostile_instruction_files_are_not_read() {
    let base = fresh_dir("dsh-instr-hostile")
        .unwrap()
        .canonicalize()
        .unwrap();
    let repo = base.join("repo");
    std::fs::create_dir_all(repo.join(".git")).unwrap();
    write(&base.join("secret"), "PRIVATE KEY");
    std::os::unix::fs::symlink(base.join("secret"), repo.join("AGENTS.md")).unwrap();
    nix::unistd::mkfifo(
        &repo.join("CLAUDE.md"),
        nix::sys::stat::Mode::from_bits_truncate(0o600),
    )
    .unwrap();
    write(&repo.join("a/AGENTS.md"), &"x".repeat(65 * 1024));
    std::fs::create_dir_all(repo.join("a/b")).unwrap();
    std::fs::write(repo.join("a/b/AGENTS.md"), [0xff, 0xfe, b'h', b'i']).unwrap();
    write(&repo.join("a/b/c/AGENTS.md"), "the only good one");
    let found = sources(&repo.join("a/b/c"), None);
    assert_eq!(texts(&found), ["the only good one"]);
    assert!(!load(&repo.join("a/b/c"), None).unwrap().contains("PRIVATE"));
    // The budget: files past it are named, not loaded.
    let big = |n: usize| Source {
        path: format!("/p/{n}/AGENTS.md").into(),
        text: "y".repeat(12 * 1024),
    };
    let section = render(&[big(1), big(2), big(3)]).unwrap();
    assert!(section.len() <= MAX_TOTAL_BYTES + 200, "{}", section.len());
    assert!(section.contains("## From /p/2/AGENTS.md"));
    assert!(section.contains("Not loaded") && section.contains("/p/3/AGENTS.md"));
    assert!(!section.contains("## From /p/3/AGENTS.md"));
}
