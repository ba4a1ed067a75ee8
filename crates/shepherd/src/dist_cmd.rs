//! `shepherd dist DIR` (hidden): writes the man pages and the shell completions, generated from
//! the CLI's own definition so they never drift from it, for `scripts/package.sh`.

use std::path::Path;

use anyhow::{Context, Result};
use clap_complete::Shell;

/// Writes `DIR/man/*.1` (one page per command and subcommand) and `DIR/completions/` (bash,
/// zsh, fish) for `cli`.
pub fn run(cli: clap::Command, dir: &Path) -> Result<()> {
    let man = dir.join("man");
    let completions = dir.join("completions");
    for made in [&man, &completions] {
        std::fs::create_dir_all(made).with_context(|| format!("creating {}", made.display()))?;
    }
    clap_mangen::generate_to(cli.clone(), &man)
        .with_context(|| format!("writing man pages to {}", man.display()))?;
    for shell in [Shell::Bash, Shell::Zsh, Shell::Fish] {
        let mut cli = cli.clone();
        clap_complete::generate_to(shell, &mut cli, "shepherd", &completions)
            .with_context(|| format!("writing {shell} completions to {}", completions.display()))?;
    }
    Ok(())
}
