//! The command line's surface against its definition (`src/cli/args.rs`, included here
//! as it is): `docs/cli.md` has a `## bloomgate …` section for every subcommand, a row for
//! every flag, no row for a flag that does not exist, and clap's defaults; every `--help`
//! ends with an example; `--version`, completions and manual pages come out of the binary.

#[allow(dead_code)]
#[path = "../src/cli/args.rs"]
mod args;

use std::collections::BTreeMap;

use clap::CommandFactory;

/// One documented flag: its default as written (`none` when there is none).
type Rows = BTreeMap<String, String>;

/// The `## bloomgate …` sections of the page, each with its table rows.
fn documented(page: &str) -> BTreeMap<String, Rows> {
    let mut sections = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in page.lines() {
        if let Some(title) = line.strip_prefix("## ") {
            current = title
                .starts_with("bloomgate")
                .then(|| title.trim().to_owned());
            if let Some(c) = &current {
                sections.insert(c.clone(), Rows::new());
            }
            continue;
        }
        let (Some(section), Some(row)) = (&current, line.strip_prefix("| `")) else {
            continue;
        };
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        let Some(&[names, default]) = cells.get(..2) else {
            continue;
        };
        let default = default.trim_matches('`').to_owned();
        // `-o`, `--output <FILE>`: the long name; `<path>`: a positional.
        let name = format!("`{names}")
            .split('`')
            .filter(|part| part.starts_with("--") || part.starts_with('<'))
            .map(|part| part.split(' ').next().unwrap_or(part).to_owned())
            .next();
        if let (Some(name), Some(rows)) = (name, sections.get_mut(section)) {
            rows.insert(name, default);
        }
    }
    sections
}

/// Every command under `cmd` (itself included) by its full name, with its arguments
/// and their defaults as the page writes them. Arguments of `global` flags belong to
/// the root only.
fn defined(cmd: &clap::Command, name: &str, out: &mut BTreeMap<String, Rows>) {
    let mut rows = Rows::new();
    for arg in cmd.get_arguments() {
        let id = arg.get_id().as_str();
        if id == "help" || id == "version" || (arg.is_global_set() && name != "bloomgate") {
            continue;
        }
        let key = match arg.get_long() {
            Some(long) => format!("--{long}"),
            None => format!("<{id}>"),
        };
        let defaults: Vec<String> = arg
            .get_default_values()
            .iter()
            .map(|v| v.to_string_lossy().into_owned())
            .collect();
        let default = if defaults.is_empty() {
            "none".to_owned()
        } else {
            defaults.join(",")
        };
        rows.insert(key, default);
    }
    out.insert(name.to_owned(), rows);
    for sub in cmd.get_subcommands() {
        if sub.get_name() != "help" {
            defined(sub, &format!("{name} {}", sub.get_name()), out);
        }
    }
}

#[test]
fn docs_cli_md_documents_every_subcommand_flag_and_default_and_nothing_else() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/cli.md");
    let page = std::fs::read_to_string(path).expect("read docs/cli.md");
    let docs = documented(&page);
    let mut code = BTreeMap::new();
    let mut root = args::Cli::command();
    root.build();
    defined(&root, "bloomgate", &mut code);

    let mut problems = Vec::new();
    for (command, flags) in &code {
        let Some(rows) = docs.get(command) else {
            problems.push(format!("`{command}` has no `## {command}` section"));
            continue;
        };
        for (flag, default) in flags {
            match rows.get(flag) {
                None => problems.push(format!("{command}: {flag} is not documented")),
                Some(doc) if doc != default => problems.push(format!(
                    "{command}: {flag} is documented with default `{doc}`, but its default is `{default}`"
                )),
                Some(_) => {}
            }
        }
        for flag in rows.keys().filter(|f| !flags.contains_key(*f)) {
            problems.push(format!(
                "{command}: {flag} is documented but does not exist"
            ));
        }
    }
    for command in docs.keys().filter(|c| !code.contains_key(*c)) {
        problems.push(format!(
            "`## {command}` documents a command that does not exist"
        ));
    }
    assert!(
        problems.is_empty(),
        "docs/cli.md does not match the command line:\n  {}",
        problems.join("\n  ")
    );
}

#[test]
fn every_subcommand_help_ends_with_an_example() {
    fn walk(cmd: &clap::Command, name: &str) {
        for sub in cmd.get_subcommands().filter(|s| s.get_name() != "help") {
            let full = format!("{name} {}", sub.get_name());
            let after = sub
                .get_after_help()
                .map(|h| h.to_string())
                .unwrap_or_default();
            assert!(
                after.starts_with("Example:\n  bloomgate "),
                "`{full}` --help has no example"
            );
            walk(sub, &full);
        }
    }
    let mut root = args::Cli::command();
    root.build();
    walk(&root, "bloomgate");
}

/// Runs the built binary; its exit code and standard output.
fn bloomgate(args: &[&str]) -> (i32, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_bloomgate"))
        .args(args)
        .output()
        .expect("run bloomgate");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn version_names_the_commit_and_completions_and_man_pages_are_generated() {
    let (code, version) = bloomgate(&["--version"]);
    assert_eq!(code, 0);
    let commit = version
        .trim()
        .strip_prefix(concat!(
            "bloomgate ",
            env!("CARGO_PKG_VERSION"),
            " (commit "
        ))
        .and_then(|rest| rest.strip_suffix(')'))
        .unwrap_or_else(|| panic!("no commit in {version:?}"));
    assert!(
        commit == "unknown" || (commit.len() >= 7 && commit.bytes().all(|b| b.is_ascii_hexdigit())),
        "{commit:?}"
    );
    assert_eq!(commit, env!("BLOOMGATE_GIT_COMMIT"));

    for shell in ["bash", "zsh", "fish"] {
        let (code, script) = bloomgate(&["completions", shell]);
        assert_eq!(code, 0, "{shell}");
        assert!(
            script.contains("check-config") && script.contains("database-url"),
            "{shell}: {script}"
        );
    }

    let (code, page) = bloomgate(&["man"]);
    assert_eq!(code, 0);
    assert!(
        page.starts_with(".ie") || page.contains(".TH bloomgate"),
        "{page}"
    );
    let dir = tempfile::TempDir::new().expect("temp dir");
    let out = dir.path().join("man1");
    let (code, listed) = bloomgate(&["man", "--out-dir", out.to_str().unwrap_or_default()]);
    assert_eq!(code, 0, "{listed}");
    for name in [
        "bloomgate",
        "bloomgate-serve",
        "bloomgate-check-config",
        "bloomgate-filter",
        "bloomgate-filter-build",
        "bloomgate-filter-inspect",
        "bloomgate-demo",
        "bloomgate-init",
        "bloomgate-completions",
        "bloomgate-man",
    ] {
        let path = out.join(format!("{name}.1"));
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e}; listed: {listed}", path.display()));
        assert!(text.contains(&format!(".TH {name}")), "{name}: {text}");
    }
    let init = std::fs::read_to_string(out.join("bloomgate-init.1")).unwrap_or_default();
    assert!(
        init.contains("database\\-url") && init.contains("Example"),
        "{init}"
    );
}
