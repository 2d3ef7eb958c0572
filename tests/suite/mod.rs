mod acp;
mod architecture;
mod cli;
mod conformance;
mod dashboard;
mod embedding;
mod hardening;
mod multi;
mod peers;
mod persistence;
mod run;
mod trust;
mod web;

/// Whether a live (not zombie) process's command line holds `token`.
pub(crate) fn running(token: &str) -> bool {
    std::fs::read_dir("/proc").unwrap().flatten().any(|p| {
        let stat = std::fs::read_to_string(p.path().join("stat")).unwrap_or_default();
        let zombie = stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('Z'));
        !zombie
            && std::fs::read(p.path().join("cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(token))
                .unwrap_or(false)
    })
}
