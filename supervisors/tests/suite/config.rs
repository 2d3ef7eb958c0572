//! `cordis.yml`: one test per class of bad config (full error text), patches,
//! interpolation, hot reload with rollback.

use std::path::PathBuf;
use std::sync::Arc;

use dsh_supervisors::config::{InterpolationError, interpolate, plan_texts};
use dsh_supervisors::scratch::fresh_dir;
use dsh_supervisors::{BoxError, Catalogue, Context, Loader, Plugin, Source, Status, TreeChange};
use schemars::JsonSchema;
use serde::Deserialize;

use super::common::{bounded, runtime, wait_change};

#[allow(dead_code)] // parsed to prove validation; not every field is used
#[derive(Deserialize, JsonSchema)]
struct StoreConfig {
    path: String,
    #[serde(default)]
    retries: u32,
    #[serde(default)]
    limits: Option<Limits>,
}

#[allow(dead_code)]
#[derive(Deserialize, JsonSchema)]
struct Limits {
    max: u32,
}

/// Provides service `store:<id>` holding its path; refuses the path `fail`.
struct Store;

impl Plugin for Store {
    type Config = StoreConfig;

    fn name(&self) -> &str {
        "store"
    }

    async fn apply(&self, ctx: Context, config: Arc<StoreConfig>) -> Result<(), BoxError> {
        if config.path == "fail" {
            return Err("cannot open store at `fail`".into());
        }
        let name = format!("store:{}", ctx.fiber().name());
        ctx.provide(&name, Arc::new(config.path.clone()))?;
        Ok(())
    }
}

fn catalogue() -> Catalogue {
    let mut c = Catalogue::new();
    c.register("store", || Store);
    c
}

fn check(yaml: &str) -> String {
    let texts = [("cordis.yml".to_owned(), yaml.to_owned())];
    let lookup = |name: &str| (name == "DSH_TEST_ROOT").then(|| "/srv".to_owned());
    match plan_texts(&texts, &catalogue(), &lookup) {
        Ok(plan) => format!("ok: {} entries", plan.flatten().len()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_valid_file_plans_with_interpolation_and_groups() {
    let yaml = "\
plugins:
  - id: main
    name: store
    config:
      path: ${DSH_TEST_ROOT}/main
      retries: ${DSH_TEST_RETRIES:-3}
  - id: extra
    group:
      - id: side
        name: store
        config: { path: side }
        disabled: true
";
    let texts = [("cordis.yml".to_owned(), yaml.to_owned())];
    let lookup = |name: &str| (name == "DSH_TEST_ROOT").then(|| "/srv".to_owned());
    let plan = plan_texts(&texts, &catalogue(), &lookup).unwrap();
    let flat = plan.flatten();
    assert_eq!(flat.len(), 3);
    assert_eq!(
        flat[0].0.config,
        serde_json::json!({"path": "/srv/main", "retries": 3})
    );
    assert_eq!(flat[2].1, Some("extra"));
    assert!(flat[2].0.disabled);
}

#[test]
fn unknown_plugin() {
    let yaml = "plugins:\n  - id: x\n    name: nope\n";
    assert_eq!(
        check(yaml),
        "cordis.yml:3: entry `x`, field `name`: unknown plugin `nope` (known: `store`)"
    );
}

#[test]
fn unknown_field_in_config_and_in_entry() {
    let yaml =
        "plugins:\n  - id: s\n    name: store\n    config:\n      path: a\n      colour: red\n";
    assert_eq!(
        check(yaml),
        "cordis.yml:6: entry `s`, field `config.colour`: unknown field `colour` (expected one of `limits`, `path`, `retries`)"
    );
    let nested = "plugins:\n  - id: s\n    name: store\n    config:\n      path: a\n      limits:\n        max: 3\n        min: 1\n";
    assert_eq!(
        check(nested),
        "cordis.yml:8: entry `s`, field `config.limits.min`: unknown field `min` (expected one of `max`)"
    );
    let entry = "plugins:\n  - id: s\n    name: store\n    colour: red\n    config: { path: a }\n";
    assert_eq!(
        check(entry),
        "cordis.yml:4: entry `s`, field `colour`: unknown field (expected one of `id`, `name`, `config`, `disabled`, `group`)"
    );
}

/// An internally tagged config: each variant has its own fields (and no
/// `deny_unknown_fields`: the schema check catches strays).
#[allow(dead_code)]
#[derive(Deserialize, JsonSchema)]
#[serde(tag = "kind", rename_all = "lowercase")]
enum Sink {
    File { path: String },
    Socket { host: String, port: u16 },
}

struct SinkPlugin;

impl Plugin for SinkPlugin {
    type Config = Sink;

    fn name(&self) -> &str {
        "sink"
    }

    async fn apply(&self, _ctx: Context, _config: Arc<Sink>) -> Result<(), BoxError> {
        Ok(())
    }
}

#[test]
fn tagged_enum_configs_check_fields_against_their_own_variant() {
    let mut c = Catalogue::new();
    c.register("sink", || SinkPlugin);
    let run = |config: &str| {
        let texts = [(
            "cordis.yml".to_owned(),
            format!("plugins:\n  - id: s\n    name: sink\n    config: {config}\n"),
        )];
        match plan_texts(&texts, &c, &|_: &str| None) {
            Ok(_) => "ok".to_owned(),
            Err(e) => e.to_string(),
        }
    };
    assert_eq!(run("{ kind: socket, host: h, port: 1 }"), "ok");
    assert_eq!(run("{ kind: file, path: /x }"), "ok");
    let wrong = run("{ kind: file, path: /x, port: 1 }");
    assert!(
        wrong
            .contains("field `config.port`: unknown field `port` (expected one of `kind`, `path`)"),
        "{wrong}"
    );
}

#[test]
fn missing_field() {
    let yaml = "plugins:\n  - id: s\n    name: store\n    config:\n      retries: 2\n";
    assert_eq!(
        check(yaml),
        "cordis.yml:5: entry `s`, field `config`: missing field `path`"
    );
    let no_name = "plugins:\n  - id: s\n";
    assert_eq!(
        check(no_name),
        "cordis.yml:2: entry `s`, field `name`: missing field `name` (the plugin to load)"
    );
    let no_id = "plugins:\n  - name: store\n";
    assert_eq!(
        check(no_id),
        "cordis.yml:2: field `plugins[0].id`: missing field `id`"
    );
}

#[test]
fn wrong_type() {
    let yaml =
        "plugins:\n  - id: s\n    name: store\n    config:\n      path: a\n      retries: many\n";
    assert_eq!(
        check(yaml),
        "cordis.yml:6: entry `s`, field `config.retries`: invalid type: string \"many\", expected u32"
    );
    let disabled =
        "plugins:\n  - id: s\n    name: store\n    disabled: sometimes\n    config: { path: a }\n";
    assert_eq!(
        check(disabled),
        "cordis.yml:4: entry `s`, field `disabled`: expected true or false, found \"sometimes\""
    );
}

#[test]
fn duplicate_id() {
    let yaml = "plugins:\n  - id: s\n    name: store\n    config: { path: a }\n  - id: g\n    group:\n      - id: s\n        name: store\n        config: { path: b }\n";
    assert_eq!(
        check(yaml),
        "cordis.yml:7: entry `s`, field `id`: duplicate id (first used at line 2)"
    );
}

#[test]
fn bad_yaml() {
    let yaml = "plugins:\n  - id: s\n    name: [store\n";
    let text = check(yaml);
    assert!(text.starts_with("cordis.yml:"), "{text}");
    assert!(text.contains(": invalid YAML: "), "{text}");
    let not_a_map = "- id: s\n";
    assert_eq!(
        check(not_a_map),
        "cordis.yml:1: expected a mapping with a `plugins` list, found a list"
    );
    assert_eq!(
        check(""),
        "cordis.yml: the file is empty; expected a mapping with a `plugins` list"
    );
}

#[test]
fn unset_environment_variable() {
    let yaml =
        "plugins:\n  - id: s\n    name: store\n    config:\n      path: ${DSH_TEST_UNSET}/x\n";
    assert_eq!(
        check(yaml),
        "cordis.yml:5: entry `s`, field `config.path`: environment variable `DSH_TEST_UNSET` is not set (use `${DSH_TEST_UNSET:-default}` for a fallback)"
    );
}

#[test]
fn every_problem_is_reported_together() {
    let yaml = "plugins:\n  - id: a\n    name: nope\n  - id: b\n    name: store\n    config: { path: 1, retries: -1 }\n";
    let text = check(yaml);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{text}");
    assert!(lines[0].starts_with("cordis.yml:3: entry `a`"), "{text}");
    assert!(
        lines[1].starts_with("cordis.yml:6: entry `b`, field `config."),
        "{text}"
    );
}

#[test]
fn interpolation_rules() {
    let env = |n: &str| match n {
        "HOME_DIR" => Some("/home/x".to_owned()),
        _ => None,
    };
    assert_eq!(interpolate("${HOME_DIR}/a", &env).unwrap(), "/home/x/a");
    assert_eq!(interpolate("${NOPE:-fallback}", &env).unwrap(), "fallback");
    assert_eq!(
        interpolate("cost $5 and $${HOME_DIR}", &env).unwrap(),
        "cost $5 and ${HOME_DIR}"
    );
    assert_eq!(
        interpolate("${HOME_DIR", &env),
        Err(InterpolationError::Unclosed {
            text: "${HOME_DIR".into()
        })
    );
    assert_eq!(
        interpolate("${not valid}", &env),
        Err(InterpolationError::NotAReference {
            body: "not valid".into()
        })
    );
    let unset = interpolate("${NOPE}", &env).unwrap_err();
    assert_eq!(
        unset,
        InterpolationError::Unset {
            name: "NOPE".into()
        }
    );
    assert!(unset.to_string().contains("`NOPE` is not set"), "{unset}");
}

#[test]
fn patches_apply_by_id_and_report_their_own_file() {
    let base = "plugins:\n  - id: a\n    name: store\n    config:\n      path: base\n      retries: 1\n  - id: g\n    group:\n      - id: b\n        name: store\n        config: { path: b }\n";
    let patch = "plugins:\n  - id: a\n    config:\n      retries: 5\n  - id: b\n    disabled: true\n  - id: c\n    name: store\n    config: { path: c }\n";
    let texts = [
        ("cordis.yml".to_owned(), base.to_owned()),
        ("local.yml".to_owned(), patch.to_owned()),
    ];
    let plan = plan_texts(&texts, &catalogue(), &|_| None).unwrap();
    let flat = plan.flatten();
    let ids: Vec<&str> = flat.iter().map(|(e, _)| e.id.as_str()).collect();
    assert_eq!(ids, ["a", "g", "b", "c"]);
    assert_eq!(
        flat[0].0.config,
        serde_json::json!({"path": "base", "retries": 5})
    );
    assert!(flat[2].0.disabled);
    let bad_patch = "plugins:\n  - id: a\n    config:\n      retries: lots\n";
    let texts = [
        ("cordis.yml".to_owned(), base.to_owned()),
        ("local.yml".to_owned(), bad_patch.to_owned()),
    ];
    let err = plan_texts(&texts, &catalogue(), &|_| None)
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "local.yml:4: entry `a`, field `config.retries`: invalid type: string \"lots\", expected u32"
    );
}

fn temp_file(contents: &str) -> PathBuf {
    let dir = fresh_dir("dsh-config-test").unwrap();
    let path = dir.join("cordis.yml");
    std::fs::write(&path, contents).unwrap();
    path
}

const TWO_STORES: &str = "plugins:\n  - id: a\n    name: store\n    config: { path: one }\n  - id: b\n    name: store\n    config: { path: two }\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_replaces_only_changed_entries_and_rolls_back_failures() {
    let rt = runtime().await;
    let path = temp_file(TWO_STORES);
    let (loader, failures) = Loader::boot(&rt, catalogue(), Source::new(&path))
        .await
        .unwrap();
    assert!(failures.is_empty());
    let a1 = loader.fiber("a").await.unwrap();
    let b1 = loader.fiber("b").await.unwrap();
    let store_a = |rt: &dsh_supervisors::Runtime| {
        rt.root()
            .get::<String>("store:plugin/store#a")
            .map(|s| s.to_string())
    };
    assert_eq!(store_a(&rt).as_deref(), Some("one"));

    // A failing new config rolls back to the old one; b is untouched.
    std::fs::write(&path, TWO_STORES.replace("path: one", "path: fail")).unwrap();
    let report = loader.reload().await;
    assert_eq!(report.rolled_back.len(), 1, "{report:?}");
    assert_eq!(report.rolled_back[0].0, "a");
    assert!(
        report.rolled_back[0]
            .1
            .contains("cannot open store at `fail`"),
        "{report:?}"
    );
    let a2 = loader.fiber("a").await.unwrap();
    assert_eq!(a1.status(), Status::Disposed);
    assert_eq!(a2.status(), Status::Active);
    assert_eq!(store_a(&rt).as_deref(), Some("one"));
    assert_eq!(loader.fiber("b").await.unwrap().id(), b1.id());

    // A valid change applies; b still untouched.
    std::fs::write(&path, TWO_STORES.replace("path: one", "path: three")).unwrap();
    let report = loader.reload().await;
    assert_eq!(report.applied, ["a"]);
    assert_eq!(store_a(&rt).as_deref(), Some("three"));
    assert_eq!(loader.fiber("b").await.unwrap().id(), b1.id());

    // An invalid file changes nothing.
    std::fs::write(
        &path,
        "plugins:\n  - id: a\n    name: store\n    config: { path: three, extra: 1 }\n",
    )
    .unwrap();
    let report = loader.reload().await;
    let rejected = report.rejected.unwrap().to_string();
    assert!(
        rejected.contains("field `config.extra`: unknown field"),
        "{rejected}"
    );
    assert_eq!(store_a(&rt).as_deref(), Some("three"));
    assert_eq!(b1.status(), Status::Active);

    // Removing an entry disposes it.
    std::fs::write(
        &path,
        "plugins:\n  - id: a\n    name: store\n    config: { path: three }\n",
    )
    .unwrap();
    let report = loader.reload().await;
    assert_eq!(report.applied, ["b"]);
    assert_eq!(b1.status(), Status::Disposed);
    bounded("shutdown", rt.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watcher_reloads_when_the_file_changes() {
    let rt = runtime().await;
    let path = temp_file(TWO_STORES);
    let (loader, _) = Loader::boot(&rt, catalogue(), Source::new(&path))
        .await
        .unwrap();
    loader.watch().await.unwrap();
    let watcher = rt
        .tree()
        .snapshot()
        .into_iter()
        .find(|n| n.name == "config/watch")
        .unwrap();
    assert_eq!(watcher.parent, Some(loader.host().id()));
    let mut feed = rt.tree().subscribe();
    std::fs::write(&path, TWO_STORES.replace("path: two", "path: four")).unwrap();
    wait_change(
        &mut feed,
        |c| matches!(c, TreeChange::Spawned { node } if &*node.info.name == "plugin/store#b"),
    )
    .await;
    bounded("reload applied", async {
        while rt
            .root()
            .get::<String>("store:plugin/store#b")
            .map(|s| s.to_string())
            .as_deref()
            != Some("four")
        {
            tokio::task::yield_now().await;
        }
    })
    .await;
    bounded("shutdown", rt.shutdown()).await;
}
