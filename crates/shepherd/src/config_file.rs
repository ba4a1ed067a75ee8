//! Config files for subcommands: a TOML table whose keys are the subcommand's long flag names.
//! Precedence: command-line flag, then environment variable, then config file, then default.
//! The file's values are turned into flags placed right after the subcommand name, so clap
//! validates them exactly like typed flags and names the setting in its errors.

use std::ffi::OsString;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};

/// The config file named by `--config` (or `SHEPHERD_CONFIG`), if any.
fn config_path(argv: &[OsString]) -> Option<PathBuf> {
    let mut it = argv.iter();
    while let Some(a) = it.next() {
        let a = a.to_string_lossy();
        if a == "--config" {
            return it.next().map(PathBuf::from);
        }
        if let Some(p) = a.strip_prefix("--config=") {
            return Some(PathBuf::from(p));
        }
    }
    std::env::var_os("SHEPHERD_CONFIG").map(PathBuf::from)
}

/// A command line with the config file's settings added.
#[derive(Debug)]
pub struct Merged {
    /// The arguments to parse.
    pub argv: Vec<OsString>,
    /// Settings (long flag names) whose value came from the config file.
    pub from_file: Vec<String>,
}

/// `argv` with the config file's settings for the first of `subcommands` on the command line
/// added where no flag or environment variable sets them. `command` is the subcommands'
/// parent: the top-level command, or `config print` (whose own subcommands are the same).
pub fn merge(command: &clap::Command, subcommands: &[&str], argv: Vec<OsString>) -> Result<Merged> {
    let unchanged = |argv| {
        Ok(Merged {
            argv,
            from_file: vec![],
        })
    };
    let Some(at) = argv.iter().position(|a| subcommands.iter().any(|s| a == s)) else {
        return unchanged(argv);
    };
    let subcommand = argv[at].to_string_lossy().to_string();
    let subcommand = subcommand.as_str();
    let Some(path) = config_path(&argv[at..]) else {
        return unchanged(argv);
    };
    let sub = command
        .find_subcommand(subcommand)
        .with_context(|| format!("no subcommand {subcommand}"))?;
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("config file {}", path.display()))?;
    let table: toml::Table = text
        .parse()
        .with_context(|| format!("config file {}", path.display()))?;
    let mut injected = Vec::new();
    let mut from_file = Vec::new();
    for (key, value) in table {
        let arg = sub
            .get_arguments()
            .chain(command.get_arguments())
            .find(|a| a.get_long() == Some(key.as_str()) && key != "config")
            .with_context(|| format!("config file {}: unknown setting {key:?}", path.display()))?;
        let flag = format!("--{key}");
        let on_command_line = argv.iter().any(|a| {
            a.to_string_lossy() == flag || a.to_string_lossy().starts_with(&format!("{flag}="))
        });
        let in_env = arg
            .get_env()
            .is_some_and(|name| std::env::var_os(name).is_some());
        if on_command_line || in_env {
            continue;
        }
        from_file.push(key.clone());
        let text = match value {
            toml::Value::String(s) => s,
            toml::Value::Integer(i) => i.to_string(),
            toml::Value::Float(f) => f.to_string(),
            toml::Value::Boolean(b) if !arg.get_action().takes_values() => {
                if b {
                    injected.push(OsString::from(flag));
                }
                continue;
            }
            toml::Value::Boolean(b) => b.to_string(),
            other => bail!(
                "config file {}: setting {key:?} must be a string, number or boolean, not {}",
                path.display(),
                other.type_str()
            ),
        };
        injected.push(OsString::from(format!("{flag}={text}")));
    }
    let mut merged = argv;
    merged.splice(at + 1..at + 1, injected);
    Ok(Merged {
        argv: merged,
        from_file,
    })
}
