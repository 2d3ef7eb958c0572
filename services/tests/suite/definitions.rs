//! Agent definitions on disk: where they are found and which wins, both
//! formats (ours strict, Claude Code's lenient), and hostile files refused
//! with the file and the field named while the rest still load.

use std::path::{Path, PathBuf};
use std::time::Duration;

use dsh_services::definitions::{Dialect, discover, tool_matches};
use dsh_services::sandbox::PermissionMode;
use dsh_supervisors::scratch::fresh_dir;

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

/// A project (with `.git`, a subdirectory as the working directory) and a
/// home.
fn layout() -> (PathBuf, PathBuf, PathBuf) {
    let base = fresh_dir("dsh-definitions")
        .unwrap()
        .canonicalize()
        .unwrap();
    let (repo, home) = (base.join("repo"), base.join("home"));
    std::fs::create_dir_all(repo.join(".git")).unwrap();
    let cwd = repo.join("crates/core");
    std::fs::create_dir_all(&cwd).unwrap();
    (repo, cwd, home)
}

const REVIEWER: &str = "---\nname: reviewer\ndescription: Reviews a diff\n  for bugs.\nmodel: deepseek-v4-pro\nreasoning_effort: high\ntools: [read, grep, \"mcp__github__*\"]\npermission_mode: read-only\nmax_turns: 3\nmax_steps: 20\ntimeout: 5m\nmax_tokens: 200000\n---\nYou review diffs.\n";

#[test]
fn definitions_are_found_nearest_first_in_both_formats_and_the_user_s_last() {
    let (repo, cwd, home) = layout();
    write(&repo.join(".dsh/agents/reviewer.md"), REVIEWER);
    // Nearer: the working directory's own wins over the project root's.
    write(
        &cwd.join(".dsh/agents/tester.md"),
        "---\nname: tester\ndescription: Runs the tests near here.\n---\nRun them.\n",
    );
    write(
        &repo.join(".dsh/agents/tester.md"),
        "---\nname: tester\ndescription: Runs every test.\n---\nRun all.\n",
    );
    write(
        &repo.join(".claude/agents/explorer.md"),
        "---\nname: explorer\ndescription: Finds code.\ntools: Read, Grep, Glob, NotebookEdit\nmodel: inherit\ncolor: blue\nhooks:\n  PreToolUse: []\npermissionMode: plan\nstyle: terse\n---\nExplore.\n",
    );
    write(
        &home.join("agents/writer.md"),
        "---\nname: writer\ndescription: Writes docs.\n---\nWrite.\n",
    );
    let all = discover(&cwd, Some(&home));
    assert!(all.errors.is_empty(), "{:?}", all.errors);
    let names: Vec<&str> = all.found.keys().map(String::as_str).collect();
    assert_eq!(names, ["explorer", "reviewer", "tester", "writer"]);
    assert_eq!(all.found["tester"].description, "Runs the tests near here.");
    assert_eq!(all.hidden, [repo.join(".dsh/agents/tester.md")]);

    let r = &all.found["reviewer"];
    assert_eq!(r.description, "Reviews a diff for bugs.");
    assert_eq!(r.model.as_deref(), Some("deepseek-v4-pro"));
    assert_eq!(r.reasoning_effort.as_deref(), Some("high"));
    assert_eq!(
        r.tools.as_deref().unwrap(),
        ["read", "grep", "mcp__github__*"]
    );
    assert_eq!(r.permission_mode, Some(PermissionMode::ReadOnly));
    assert_eq!(
        (r.max_turns, r.max_steps, r.max_tokens),
        (Some(3), Some(20), Some(200_000))
    );
    assert_eq!(r.timeout, Some(Duration::from_secs(300)));
    assert_eq!(r.prompt, "You review diffs.");
    assert_eq!(r.dialect, Dialect::Dsh);

    // Claude Code's file: its tool names mapped, `inherit` the parent's
    // model, and what is not ours said, never run.
    let e = &all.found["explorer"];
    assert_eq!(e.dialect, Dialect::Claude);
    assert_eq!(e.tools.as_deref().unwrap(), ["read", "grep", "glob"]);
    assert_eq!(e.model, None);
    assert_eq!(e.permission_mode, None);
    let warned = e.warnings.join("\n");
    for said in ["NotebookEdit", "hooks", "never run", "plan", "`style`"] {
        assert!(warned.contains(said), "{said}: {warned}");
    }
    assert!(!warned.contains("color"), "{warned}");

    assert!(tool_matches(
        r.tools.as_deref().unwrap(),
        "mcp__github__create_issue"
    ));
    assert!(!tool_matches(r.tools.as_deref().unwrap(), "bash"));
    assert!(!tool_matches(r.tools.as_deref().unwrap(), "mcp__gitlab__x"));
    // A pattern of many stars is matched in linear time, not exponential.
    let stars = vec![format!("{}q", "*".repeat(100))];
    assert!(!tool_matches(&stars, &"a".repeat(100)));
    assert!(tool_matches(&stars, &format!("{}q", "a".repeat(100))));
    assert!(tool_matches(&["a*b*c".into()], "axxbyyc"));
    assert!(!tool_matches(&["a*b*c".into()], "axxbyy"));
}

#[test]
fn a_hostile_definition_is_refused_with_its_file_and_field_and_the_rest_load() {
    let (repo, cwd, home) = layout();
    let agents = repo.join(".dsh/agents");
    write(
        &agents.join("good.md"),
        "---\nname: good\ndescription: Fine.\n---\nWork.\n",
    );
    let secret = repo.join("secret.txt");
    write(&secret, "---\nname: leak\ndescription: x\n---\nthe key\n");
    std::os::unix::fs::symlink(&secret, agents.join("link.md")).unwrap();
    write(
        &agents.join("huge.md"),
        &format!(
            "---\nname: huge\ndescription: x\n---\n{}",
            "a".repeat(1 << 20)
        ),
    );
    write(&agents.join("yaml.md"), "---\nname: [unclosed\n---\nx\n");
    write(
        &agents.join("unknown.md"),
        "---\nname: unknown\ndescription: x\nhooks: {}\n---\nx\n",
    );
    write(
        &agents.join("url.md"),
        "---\nname: url\ndescription: x\nmodel: https://evil.example/v1\n---\nx\n",
    );
    write(
        &agents.join("mode.md"),
        "---\nname: mode\ndescription: x\npermission_mode: root\n---\nx\n",
    );
    write(&agents.join("bare.md"), "no front matter\n");
    write(
        &agents.join("twin.md"),
        "---\nname: good\ndescription: Again.\n---\nx\n",
    );
    let all = discover(&cwd, Some(&home));
    let names: Vec<&str> = all.found.keys().map(String::as_str).collect();
    assert_eq!(names, ["good"], "{:?}", all.errors);
    let said = |file: &str| -> String {
        all.errors
            .iter()
            .find(|e| e.path == agents.join(file))
            .unwrap_or_else(|| panic!("{file} not refused: {:?}", all.errors))
            .to_string()
    };
    assert!(said("link.md").contains("symbolic link; not followed"));
    assert!(said("huge.md").contains("a definition is at most 65536"));
    assert!(said("yaml.md").contains("front matter"));
    assert!(said("unknown.md").contains("unknown field `hooks`"));
    assert!(said("url.md").contains("`model`") && said("url.md").contains("URL"));
    assert!(said("mode.md").contains("`permission_mode`"));
    assert!(said("bare.md").contains("no YAML front matter"));
    assert!(said("twin.md").contains("`good` is also defined by"));
    // Every refusal starts with its file.
    for e in &all.errors {
        assert!(
            e.to_string().starts_with(&agents.display().to_string()),
            "{e}"
        );
    }
    // A symlinked root is not followed either.
    let elsewhere = repo.join("elsewhere");
    write(
        &elsewhere.join("x.md"),
        "---\nname: x\ndescription: x\n---\nx\n",
    );
    std::os::unix::fs::symlink(&elsewhere, cwd.join(".claude")).unwrap_or(());
    std::fs::create_dir_all(cwd.join(".dsh")).unwrap();
    std::os::unix::fs::symlink(&elsewhere, cwd.join(".dsh/agents")).unwrap();
    // A linked `.dsh` above a real `agents` is not followed either.
    let linked = repo.join("linked");
    write(
        &linked.join("agents/y.md"),
        "---\nname: y\ndescription: y\n---\ny\n",
    );
    let sub = cwd.join("sub");
    std::fs::create_dir_all(&sub).unwrap();
    std::os::unix::fs::symlink(&linked, sub.join(".dsh")).unwrap();
    let deeper = discover(&sub, Some(&home));
    assert!(!deeper.found.contains_key("y"), "{:?}", deeper.found.keys());
    let again = discover(&cwd, Some(&home));
    assert!(!again.found.contains_key("x"));
    assert!(
        again
            .errors
            .iter()
            .any(|e| e.path == cwd.join(".dsh/agents") && e.reason.contains("symbolic link")),
        "{:?}",
        again.errors
    );
    assert!(
        again
            .require("nope")
            .unwrap_err()
            .to_string()
            .contains("found: good")
    );
}
