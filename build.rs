//! Stamps the binary with the commit it was built from, for `bloomgate --version`:
//! `BLOOMGATE_GIT_COMMIT` when set, else `git rev-parse --short HEAD`, else "unknown"
//! (a source tarball, or no git).

use std::path::Path;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=BLOOMGATE_GIT_COMMIT");
    let commit = std::env::var("BLOOMGATE_GIT_COMMIT")
        .ok()
        .filter(|c| !c.trim().is_empty())
        .or_else(|| {
            watch_head();
            git(&["rev-parse", "--short", "HEAD"])
        })
        .unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=BLOOMGATE_GIT_COMMIT={}", commit.trim());
}

/// Reruns this script when HEAD moves: HEAD itself (a checkout) and the branch it names
/// (a commit). In a worktree both live outside `.git`, so git is asked where.
fn watch_head() {
    let Some(head) = git(&["rev-parse", "--git-path", "HEAD"]) else {
        return;
    };
    println!("cargo:rerun-if-changed={head}");
    if let Ok(text) = std::fs::read_to_string(Path::new(&head))
        && let Some(branch) = text.trim().strip_prefix("ref: ")
        && let Some(path) = git(&["rev-parse", "--git-path", branch])
    {
        println!("cargo:rerun-if-changed={path}");
    }
}

/// The trimmed standard output of a git command that succeeded.
fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?;
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_owned())
}
