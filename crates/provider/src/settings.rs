//! A setting that makes no sense, found when a loop is configured: the one error of every
//! start-up check in this crate, so a bad configuration stops the process before it opens the
//! BMDB, with a message that names the setting.

/// A setting and what is wrong with it; shown as `SETTING: PROBLEM`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{setting}: {problem}")]
pub struct InvalidSetting {
    /// The setting as an operator writes it (a flag's name, an inventory field).
    pub setting: String,
    /// What is wrong with its value.
    pub problem: String,
}

impl InvalidSetting {
    /// `setting` is wrong because of `problem`.
    pub fn new(setting: impl Into<String>, problem: impl Into<String>) -> Self {
        InvalidSetting {
            setting: setting.into(),
            problem: problem.into(),
        }
    }
}
