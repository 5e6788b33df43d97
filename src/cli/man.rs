//! `bloomgate man`: manual pages made from the command line's own definition, so they
//! cannot drift from `--help`. Printing and file writing only.

use std::io::Write;
use std::path::Path;

use anyhow::Context;

/// Prints `bloomgate.1` to standard output, or, with `out_dir`, writes it there together
/// with a page per subcommand (`bloomgate-serve.1`, `bloomgate-filter-build.1`, …).
pub fn write(cmd: clap::Command, out_dir: Option<&Path>) -> anyhow::Result<()> {
    let Some(dir) = out_dir else {
        let mut out = std::io::stdout().lock();
        clap_mangen::Man::new(cmd)
            .render(&mut out)
            .context("writing the manual page")?;
        return out.flush().context("writing the manual page");
    };
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut written = Vec::new();
    write_tree(&cmd, "bloomgate", dir, &mut written)?;
    for path in written {
        println!("{path}");
    }
    Ok(())
}

/// Writes the page of `cmd` as `name.1`, then those of its subcommands as `name-sub.1`.
fn write_tree(
    cmd: &clap::Command,
    name: &str,
    dir: &Path,
    written: &mut Vec<String>,
) -> anyhow::Result<()> {
    let path = dir.join(format!("{name}.1"));
    let page = cmd
        .clone()
        .display_name(name.to_owned())
        .version(super::args::VERSION);
    let mut buf = Vec::new();
    clap_mangen::Man::new(page)
        .render(&mut buf)
        .with_context(|| format!("rendering {name}.1"))?;
    std::fs::write(&path, buf).with_context(|| format!("writing {}", path.display()))?;
    written.push(path.display().to_string());
    for sub in cmd.get_subcommands().filter(|s| s.get_name() != "help") {
        write_tree(sub, &format!("{name}-{}", sub.get_name()), dir, written)?;
    }
    Ok(())
}
