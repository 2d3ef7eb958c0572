//! `dsh check` and `dsh tree` as a user runs them.

use super::Bounded;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use dsh::kernel::scratch::fresh_dir;

fn dsh(args: &[&str], dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dsh"))
        .env_remove("DSH_BASE_URL")
        .env_remove("DSH_MODEL")
        .env_remove("DSH_APPROVAL")
        .args(args)
        .current_dir(dir)
        .bounded_output()
        .expect("the dsh binary runs")
}

fn workdir(files: &[(&str, &str)]) -> PathBuf {
    let dir = fresh_dir("dsh-cli").unwrap();
    for (name, text) in files {
        std::fs::write(dir.join(name), text).unwrap();
    }
    dir
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn check_accepts_the_default_config() {
    let _sweep = crate::suite::sweep();
    let out = dsh(&["check"], &repo());
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "cordis.yml: ok (3 entries, 3 enabled)\n");
}

#[test]
fn check_reports_every_problem_with_file_line_entry_and_field() {
    let _sweep = crate::suite::sweep();
    let dir = workdir(&[(
        "bad.yml",
        "plugins:\n  - id: s\n    name: value\n    config:\n      service: 7\n  - id: t\n    name: nope\n",
    )]);
    let out = dsh(&["check", "bad.yml"], &dir);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        text(&out.stderr),
        "bad.yml:5: entry `s`, field `config.service`: invalid type: integer `7`, expected a string\n\
         bad.yml:7: entry `t`, field `name`: unknown plugin `nope` (known: `agent-services`, `deepseek`, `hooks`, `mcp`, `openai`, `prompt-section`, `scripted`, `session-store`, `value`, `web`)\n"
    );
    assert!(out.stdout.is_empty());
}

/// A provider entry's `models` list is checked where the config is read:
/// an id listed twice, an empty id and a zero window are each named with
/// their entry and line.
#[test]
fn check_refuses_a_bad_models_list() {
    let _sweep = crate::suite::sweep();
    let good = "plugins:\n  - id: ds\n    name: deepseek\n    config:\n      context_window: 500000\n      models:\n        - id: deepseek-v4-flash\n          context_window: 128000\n          max_tokens: 8000\n        - { id: mine, images: true }\n";
    let bad = |models: &str| {
        format!(
            "plugins:\n  - id: oa\n    name: openai\n    config:\n      base_url: http://127.0.0.1:9/v1\n      models:\n{models}"
        )
    };
    let dir = workdir(&[
        ("good.yml", good),
        ("twice.yml", &bad("        - id: m\n        - id: m\n")),
        ("empty.yml", &bad("        - id: ' '\n")),
        ("zero.yml", &bad("        - { id: m, context_window: 0 }\n")),
    ]);
    let out = dsh(&["check", "good.yml"], &dir);
    assert!(out.status.success(), "{}", text(&out.stderr));
    for (file, says) in [
        ("twice.yml", "models[1]: model `m` is listed twice"),
        ("empty.yml", "models[0]: `id` is empty"),
        (
            "zero.yml",
            "models[0] (`m`): `context_window` must be at least 1",
        ),
    ] {
        let out = dsh(&["check", file], &dir);
        assert_eq!(out.status.code(), Some(2), "{file}");
        let err = text(&out.stderr);
        assert!(
            err.starts_with(&format!("{file}:"))
                && err.contains("entry `oa`")
                && err.contains(says),
            "{file}: {err}"
        );
    }
}

#[test]
fn check_applies_patches_and_reads_the_environment() {
    let _sweep = crate::suite::sweep();
    let dir = workdir(&[
        (
            "cordis.yml",
            "plugins:\n  - id: s\n    name: value\n    config: { service: s }\n",
        ),
        (
            "off.yml",
            "plugins:\n  - id: s\n    disabled: ${S_OFF:-true}\n",
        ),
    ]);
    let out = dsh(&["check", "cordis.yml", "--patch", "off.yml"], &dir);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "cordis.yml: ok (1 entries, 0 enabled)\n");
    let missing = dsh(&["check", "absent.yml"], &dir);
    assert_eq!(missing.status.code(), Some(2));
    assert!(
        text(&missing.stderr).starts_with("absent.yml: cannot read the file:"),
        "{}",
        text(&missing.stderr)
    );
}

#[test]
fn check_prints_a_plugin_schema() {
    let _sweep = crate::suite::sweep();
    let out = dsh(&["check", "--schema", "value"], &repo());
    assert!(out.status.success());
    let schema: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(schema["properties"]["service"].is_object(), "{schema}");
    let unknown = dsh(&["check", "--schema", "nope"], &repo());
    assert_eq!(unknown.status.code(), Some(2));
}

#[test]
fn tree_boots_the_config_and_prints_the_live_tree() {
    let _sweep = crate::suite::sweep();
    let out = dsh(&["tree"], &repo());
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 5, "{stdout}");
    assert!(lines[0].starts_with("root [root] active"), "{stdout}");
    assert!(
        lines[1].starts_with("  config/cordis.yml [plugin] active"),
        "{stdout}"
    );
    assert!(
        lines[2].starts_with("    plugin/value#settings [plugin] active"),
        "{stdout}"
    );
    assert!(
        lines[3].starts_with("    group/shared [plugin] active"),
        "{stdout}"
    );
    assert!(
        lines[4].starts_with("      plugin/value#limits [plugin] active"),
        "{stdout}"
    );

    let out = dsh(&["tree", "--json"], &repo());
    assert!(out.status.success());
    let nodes: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(nodes.len(), 5);
    let by_name = |n: &str| nodes.iter().find(|x| x["name"] == n).unwrap().clone();
    assert_eq!(
        by_name("plugin/value#limits")["parent"],
        by_name("group/shared")["id"]
    );
    assert_eq!(by_name("group/shared")["status"], "active");
}

#[test]
fn tree_exits_non_zero_when_an_entry_fails_or_the_config_is_bad() {
    let _sweep = crate::suite::sweep();
    let dir = workdir(&[
        (
            "fails.yml",
            "plugins:\n  - id: empty\n    name: value\n    config: { service: ' ' }\n",
        ),
        (
            "bad.yml",
            "plugins:\n  - id: x\n    name: value\n    config: { service: a, extra: 1 }\n",
        ),
    ]);
    let out = dsh(&["tree", "fails.yml"], &dir);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        text(&out.stderr),
        "entry `empty` failed to start: `service` must name a capability\n"
    );
    let out = dsh(&["tree", "bad.yml"], &dir);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        text(&out.stderr),
        "bad.yml:4: entry `x`, field `config.extra`: unknown field `extra`, expected `service` or `value`\n"
    );
}
