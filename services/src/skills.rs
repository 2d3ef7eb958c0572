//! Skills: reusable task instructions kept as Markdown files, offered to
//! the model as a catalog (names and descriptions) and loaded whole by the
//! `skill` tool when a task needs one.
//!
//! A skill is `<root>/<name>/SKILL.md` (a bundle: files beside it are its
//! resources) or `<root>/<name>.md`, with optional YAML frontmatter naming
//! its `description` and `disable-model-invocation`. Roots, first wins for a
//! name: the project's `.dsh/skills` and `.agents/skills` (the project root
//! is the nearest ancestor holding `.git`, else the working directory),
//! then the user's `~/.dsh/skills`. Files are read as the instruction files
//! are (no symlink followed at the file, regular UTF-8, at most 64 KiB).

use std::path::{Path, PathBuf};

/// Catalog descriptions are cut to this many characters.
pub const DESCRIPTION_MAX: usize = 500;

/// One discovered skill.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Skill {
    /// Its kebab-case name.
    pub name: String,
    /// What it is for (the frontmatter's, else the first paragraph).
    pub description: String,
    /// The instructions: the file without its frontmatter.
    pub body: String,
    /// The file.
    pub path: PathBuf,
    /// Where its resources are (a bundle's directory).
    pub resources: Option<PathBuf>,
    /// Whether the model may load it (`disable-model-invocation: true`
    /// keeps it for the user).
    pub model_invocable: bool,
    /// Which root it came from (`project-dsh`, `project-agents`, `user-dsh`).
    pub source: &'static str,
}

/// Whether `name` is a skill name: kebab-case letters and digits.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name.split('-').all(|part| {
            !part.is_empty()
                && part
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        })
}

/// The skill roots for an agent in `cwd`, in precedence order.
pub fn roots(cwd: &Path, home: Option<&Path>) -> Vec<(&'static str, PathBuf)> {
    let cwd = cwd.canonicalize().unwrap_or_else(|_| cwd.to_path_buf());
    let project = crate::instructions::project_root(&cwd);
    let mut out = vec![
        ("project-dsh", project.join(".dsh/skills")),
        ("project-agents", project.join(".agents/skills")),
    ];
    if let Some(home) = home {
        out.push(("user-dsh", home.join("skills")));
    }
    out
}

/// Every skill under the roots for `cwd`, sorted by name; a name found in
/// an earlier root hides the same name in later ones. Reads files: call it
/// off the async workers.
pub fn discover(cwd: &Path, home: Option<&Path>) -> Vec<Skill> {
    let mut found: Vec<Skill> = Vec::new();
    for (source, root) in roots(cwd, home) {
        let Ok(entries) = std::fs::read_dir(&root) else {
            continue;
        };
        let mut here: Vec<Skill> = entries
            .flatten()
            .filter_map(|e| load_entry(source, &e.path()))
            .collect();
        here.sort_by(|a, b| a.name.cmp(&b.name));
        for skill in here {
            if !found.iter().any(|s| s.name == skill.name) {
                found.push(skill);
            }
        }
    }
    found.sort_by(|a, b| a.name.cmp(&b.name));
    found
}

/// The skill named `name` for `cwd`, if any.
pub fn find(cwd: &Path, home: Option<&Path>, name: &str) -> Option<Skill> {
    discover(cwd, home).into_iter().find(|s| s.name == name)
}

/// A root entry as a skill: `<name>/SKILL.md` or `<name>.md`.
fn load_entry(source: &'static str, path: &Path) -> Option<Skill> {
    let file_name = path.file_name()?.to_str()?;
    let meta = path.symlink_metadata().ok()?;
    let (name, file, resources) = if meta.is_dir() {
        (
            file_name.to_owned(),
            path.join("SKILL.md"),
            Some(path.to_path_buf()),
        )
    } else {
        (
            file_name.strip_suffix(".md")?.to_owned(),
            path.to_path_buf(),
            None,
        )
    };
    if !valid_name(&name) {
        return None;
    }
    let text = crate::instructions::read_plain(&file)?;
    let (front, body) = split_frontmatter(&text);
    let front: Frontmatter = front
        .and_then(|f| serde_saphyr::from_str(f).ok())
        .unwrap_or_default();
    let description = front
        .description
        .filter(|d| !d.trim().is_empty())
        .unwrap_or_else(|| first_paragraph(body));
    Some(Skill {
        name,
        description: cap(&one_line(&description), DESCRIPTION_MAX),
        body: body.trim().to_owned(),
        path: file,
        resources,
        model_invocable: !front.disable_model_invocation.unwrap_or(false),
        source,
    })
}

#[derive(Default, serde::Deserialize)]
struct Frontmatter {
    #[serde(default)]
    description: Option<String>,
    #[serde(default, rename = "disable-model-invocation")]
    disable_model_invocation: Option<bool>,
}

/// `(frontmatter, body)` of a file that starts with a `---` block.
fn split_frontmatter(text: &str) -> (Option<&str>, &str) {
    let Some(rest) = text
        .strip_prefix("---\n")
        .or_else(|| text.strip_prefix("---\r\n"))
    else {
        return (None, text);
    };
    match rest.find("\n---") {
        Some(end) => {
            let after = &rest[end + 4..];
            let body = after.split_once('\n').map_or("", |(_, b)| b);
            (Some(&rest[..end]), body)
        }
        None => (None, text),
    }
}

fn first_paragraph(body: &str) -> String {
    body.split("\n\n")
        .map(|p| p.trim().trim_start_matches('#').trim())
        .find(|p| !p.is_empty())
        .unwrap_or("")
        .to_owned()
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn cap(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        return s.to_owned();
    }
    format!("{}…", s.chars().take(max - 1).collect::<String>())
}

/// The catalog section for `skills` (model-invocable ones only), or `None`
/// when there are none.
pub fn catalog(skills: &[Skill]) -> Option<String> {
    let lines: Vec<String> = skills
        .iter()
        .filter(|s| s.model_invocable)
        .map(|s| format!("- `{}`: {}", s.name, escape(&s.description)))
        .collect();
    if lines.is_empty() {
        return None;
    }
    Some(format!(
        "# Skills\nA skill is a set of instructions for one kind of task. These are available:\n\n<available_skills>\n{}\n</available_skills>\n\nWhen the user names a skill or the task plainly matches one, load it with the `skill` tool before you act, then follow it. This list holds summaries only: do not guess a skill's instructions before loading it.",
        lines.join("\n")
    ))
}

/// The catalog section's name and order (after the project instructions).
pub const SECTION: &str = "skills";
/// Its order.
pub const ORDER: i32 = 310;

/// The system prompt sections of an agent working in `cwd` with the dsh
/// home `home`: the project instructions, then the skills catalog (each
/// when there is one). Reads files: call it off the async workers.
pub fn workspace_sections(cwd: &Path, home: Option<&Path>) -> Vec<crate::prompt::RenderedSection> {
    let mut out = Vec::new();
    if let Some(text) = crate::instructions::load(cwd, home) {
        out.push((
            crate::instructions::SECTION.to_owned(),
            crate::instructions::ORDER,
            text,
        ));
    }
    if let Some(text) = catalog(&discover(cwd, home)) {
        out.push((SECTION.to_owned(), ORDER, text));
    }
    out
}

/// What the `skill` tool returns for `skill`.
pub fn render(skill: &Skill) -> String {
    let resources = match &skill.resources {
        Some(dir) => format!(
            "<skill_resources>\nFiles this skill refers to are relative to {}; read them only when its instructions call for them.\n</skill_resources>\n",
            dir.display()
        ),
        None => String::new(),
    };
    format!(
        "<skill_content name=\"{}\">\n{resources}<skill_instructions>\n{}\n</skill_instructions>\n</skill_content>",
        skill.name, skill.body
    )
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
