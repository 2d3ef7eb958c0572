//! Secrets stay with dsh: the environment child processes (bash, hooks,
//! tool servers) see is this process's without the variables dsh reads
//! keys and tokens from.
//!
//! Always withheld: every `*_API_KEY`, `DSH_API_KEY`, `DEEPSEEK_API_KEY`,
//! `DSH_TOKEN`; and whatever a provider or server registers as its key or
//! token variable ([`register_secret`]; a config may name any variable).
//! The environment is process-wide, so the list is too. A name the user
//! passes through explicitly (`--pass-env NAME`) is kept.

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::sync::RwLock;

static REGISTERED: RwLock<BTreeSet<String>> = RwLock::new(BTreeSet::new());

/// Variables no child process sees, not even an agent process that is
/// otherwise given the keys it needs (an ACP subagent): the tokens of this
/// process's own servers.
static SERVER_TOKENS: RwLock<BTreeSet<String>> = RwLock::new(BTreeSet::new());

/// Withholds `name` from child processes from now on.
pub fn register_secret(name: &str) {
    if let Ok(mut names) = REGISTERED.write() {
        names.insert(name.to_owned());
    }
}

/// Withholds `name` from every child process from now on, agent processes
/// included: it holds the token of a server of this process (its approvals,
/// steer and cancel).
pub fn register_server_token(name: &str) {
    register_secret(name);
    if let Ok(mut names) = SERVER_TOKENS.write() {
        names.insert(name.to_owned());
    }
}

/// The variables [`register_server_token`] named.
pub fn server_tokens() -> Vec<String> {
    SERVER_TOKENS
        .read()
        .map(|names| names.iter().cloned().collect())
        .unwrap_or_default()
}

/// Whether `name` holds something a child must not see.
pub fn is_secret(name: &str) -> bool {
    name.ends_with("_API_KEY")
        || matches!(name, "DSH_API_KEY" | "DEEPSEEK_API_KEY" | "DSH_TOKEN")
        || REGISTERED.read().is_ok_and(|names| names.contains(name))
}

/// This process's environment without its secrets, except those named in
/// `pass`.
pub fn scrubbed(pass: &[String]) -> Vec<(OsString, OsString)> {
    scrub(std::env::vars_os().collect(), pass)
}

/// `vars` without the secret ones, except those named in `pass`.
pub fn scrub(vars: Vec<(OsString, OsString)>, pass: &[String]) -> Vec<(OsString, OsString)> {
    vars.into_iter()
        .filter(|(k, _)| {
            let name = k.to_string_lossy();
            !is_secret(&name) || pass.iter().any(|p| *p == name)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_variables_are_secret_and_registered_ones_too() {
        assert!(is_secret("OPENAI_API_KEY"));
        assert!(is_secret("DEEPSEEK_API_KEY"));
        assert!(is_secret("DSH_TOKEN"));
        assert!(!is_secret("PATH"));
        assert!(!is_secret("DSH_ENV_TEST_CUSTOM_SECRET"));
        register_secret("DSH_ENV_TEST_CUSTOM_SECRET");
        assert!(is_secret("DSH_ENV_TEST_CUSTOM_SECRET"));
        assert!(!server_tokens().contains(&"DSH_ENV_TEST_CUSTOM_SECRET".to_owned()));
        register_server_token("DSH_ENV_TEST_SERVER_TOKEN");
        assert!(is_secret("DSH_ENV_TEST_SERVER_TOKEN"));
        assert!(server_tokens().contains(&"DSH_ENV_TEST_SERVER_TOKEN".to_owned()));
    }
}
