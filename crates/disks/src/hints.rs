//! Root device hints in Ironic's vocabulary, so that an operator's hints carry over: the hint
//! names (`serial`, `wwn`, `wwn_with_extension`, `wwn_vendor_extension`, `model`, `vendor`,
//! `size`, `rotational`, `hctl`, `by_path`, `name`) and the operators of oslo.utils' specs
//! matcher that Ironic's agent uses (`s==`, `s!=`, `s<`, `s<=`, `s>`, `s>=`, `<in>`, `<or>`
//! for text; `==`, `!=`, `<`, `<=`, `>`, `>=`, `<or>` for the size, and `=`, which there
//! means "at least"). As there, text is compared trimmed and in lower case, a text hint
//! without an operator means `s==`, a size without one `==`, and a size is in GiB (the
//! disk's bytes ÷ 2³⁰, not rounded).

use std::fmt;

use crate::facts::DiskFacts;

/// A hint that cannot be used, said when the inventory is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HintError {
    /// The hint's name; empty when the problem is not one hint's.
    pub hint: String,
    /// What is wrong with it.
    pub problem: String,
}

impl fmt::Display for HintError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.hint.is_empty() {
            f.write_str(&self.problem)
        } else {
            write!(f, "root device hint {}: {}", self.hint, self.problem)
        }
    }
}

impl std::error::Error for HintError {}

fn hint_error(hint: &str, problem: impl Into<String>) -> HintError {
    HintError {
        hint: hint.to_string(),
        problem: problem.into(),
    }
}

/// The facts of a disk a hint is compared with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    Name,
    Serial,
    Wwn,
    WwnWithExtension,
    WwnVendorExtension,
    Model,
    Vendor,
    Hctl,
    ByPath,
    Size,
    Rotational,
}

impl Field {
    /// Every hint's name, in the order messages list them.
    const NAMES: [&'static str; 11] = [
        "name",
        "serial",
        "wwn",
        "wwn_with_extension",
        "wwn_vendor_extension",
        "model",
        "vendor",
        "hctl",
        "by_path",
        "size",
        "rotational",
    ];

    /// The fact a hint of this name compares.
    fn named(name: &str) -> Option<Field> {
        let field = match name {
            "name" => Field::Name,
            "serial" => Field::Serial,
            "wwn" => Field::Wwn,
            "wwn_with_extension" => Field::WwnWithExtension,
            "wwn_vendor_extension" => Field::WwnVendorExtension,
            "model" => Field::Model,
            "vendor" => Field::Vendor,
            "hctl" => Field::Hctl,
            "by_path" => Field::ByPath,
            "size" => Field::Size,
            "rotational" => Field::Rotational,
            _ => return None,
        };
        Some(field)
    }

    /// The disk's text for a text hint, trimmed and in lower case.
    fn text(self, disk: &DiskFacts) -> String {
        let value = match self {
            Field::Name => &disk.name,
            Field::Serial => &disk.serial,
            Field::Wwn => &disk.wwn,
            Field::WwnWithExtension => &disk.wwn_with_extension,
            Field::WwnVendorExtension => &disk.wwn_vendor_extension,
            Field::Model => &disk.model,
            Field::Vendor => &disk.vendor,
            Field::Hctl => &disk.hctl,
            Field::ByPath => &disk.by_path,
            Field::Size | Field::Rotational => return String::new(),
        };
        value.trim().to_lowercase()
    }
}

/// How a disk's fact is compared with a hint's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    /// The hint is part of the disk's text (text only).
    In,
    /// The disk's fact is one of the hint's values.
    Or,
}

impl Op {
    /// Whether `have` (the disk's) stands to `want` (the first value) as the operator says;
    /// `values` are all of them, for `<or>`.
    fn holds<T: PartialOrd + ?Sized>(
        self,
        have: &T,
        want: &T,
        any_of: impl FnOnce() -> bool,
    ) -> bool {
        match self {
            Op::Eq => have == want,
            Op::Ne => have != want,
            Op::Lt => have < want,
            Op::Le => have <= want,
            Op::Gt => have > want,
            Op::Ge => have >= want,
            Op::Or => any_of(),
            Op::In => false,
        }
    }
}

/// One hint, parsed.
#[derive(Debug, Clone, PartialEq)]
enum Test {
    Text(Field, Op, Vec<String>),
    Size(Op, Vec<f64>),
    Rotational(bool),
}

/// The comparisons, as the size hint writes them; a text hint writes them with an `s` before
/// (`s==`). Longest first where one begins another.
const COMPARISONS: [(&str, Op); 6] = [
    ("==", Op::Eq),
    ("!=", Op::Ne),
    ("<=", Op::Le),
    (">=", Op::Ge),
    ("<", Op::Lt),
    (">", Op::Gt),
];

/// What a hint compares: text, or the size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Text,
    Size,
}

impl Kind {
    /// The operators of hints of this kind (besides `<or>`). A size's `=` is oslo.utils'
    /// "greater than or equal", and Ironic documents it so.
    fn operators(self) -> Vec<(String, Op)> {
        let prefix = if self == Kind::Text { "s" } else { "" };
        let mut ops: Vec<(String, Op)> = COMPARISONS
            .iter()
            .map(|(token, op)| (format!("{prefix}{token}"), *op))
            .collect();
        ops.push(match self {
            Kind::Text => ("<in>".into(), Op::In),
            Kind::Size => ("=".into(), Op::Ge),
        });
        ops
    }
}

/// Splits `expression` (trimmed, lower case) into its operator and values: `<or> a <or> b`
/// gives `<or>` and both values, `OP value` the operator and one value, and a bare value the
/// default, `==` or `s==`.
fn split(hint: &str, expression: &str, kind: Kind) -> Result<(Op, Vec<String>), HintError> {
    let expression = expression.trim().to_lowercase();
    if expression.is_empty() {
        return Err(hint_error(hint, "is empty"));
    }
    if expression.starts_with("<or>") {
        let values: Vec<String> = expression
            .split("<or>")
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .map(str::to_string)
            .collect();
        if values.is_empty() {
            return Err(hint_error(hint, "<or> names no value"));
        }
        return Ok((Op::Or, values));
    }
    let known = kind.operators();
    for (token, op) in &known {
        if let Some(rest) = expression.strip_prefix(token.as_str()) {
            let value = rest.trim();
            if value.is_empty() {
                return Err(hint_error(hint, format!("{token} names no value")));
            }
            return Ok((*op, vec![value.to_string()]));
        }
    }
    let other = if kind == Kind::Text {
        Kind::Size
    } else {
        Kind::Text
    };
    if let Some((op, _)) = other
        .operators()
        .into_iter()
        .find(|(op, _)| expression.starts_with(op.as_str()))
    {
        let allowed: Vec<String> = known.into_iter().map(|(t, _)| t).collect();
        return Err(hint_error(
            hint,
            format!(
                "operator {op} does not apply to it; use one of {}",
                allowed.join(" ")
            ),
        ));
    }
    Ok((Op::Eq, vec![expression]))
}

/// A JSON value as the text of a hint expression (Ironic takes numbers as text too).
fn expression_text(hint: &str, value: &serde_json::Value) -> Result<String, HintError> {
    match value {
        serde_json::Value::String(s) => Ok(s.clone()),
        serde_json::Value::Number(n) => Ok(n.to_string()),
        other => Err(hint_error(hint, format!("{other} is not text"))),
    }
}

fn parse_test(hint: &str, field: Field, value: &serde_json::Value) -> Result<Test, HintError> {
    match field {
        Field::Rotational => {
            let flag = match value {
                serde_json::Value::Bool(b) => Some(*b),
                serde_json::Value::String(s) => match s.trim().to_lowercase().as_str() {
                    "1" | "t" | "true" | "on" | "y" | "yes" => Some(true),
                    "0" | "f" | "false" | "off" | "n" | "no" => Some(false),
                    _ => None,
                },
                serde_json::Value::Number(n) => match n.as_u64() {
                    Some(1) => Some(true),
                    Some(0) => Some(false),
                    _ => None,
                },
                _ => None,
            };
            flag.map(Test::Rotational)
                .ok_or_else(|| hint_error(hint, format!("{value} is not true or false")))
        }
        Field::Size => {
            let text = expression_text(hint, value)?;
            let (op, values) = split(hint, &text, Kind::Size)?;
            let sizes = values
                .iter()
                .map(|v| match v.parse::<u64>() {
                    Ok(n) if n > 0 => Ok(n as f64),
                    _ => Err(hint_error(
                        hint,
                        format!("{v:?} is not a positive whole number of GiB"),
                    )),
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok(Test::Size(op, sizes))
        }
        _ => {
            let text = match value {
                serde_json::Value::String(s) => s.clone(),
                other => return Err(hint_error(hint, format!("{other} is not text"))),
            };
            let (op, mut values) = split(hint, &text, Kind::Text)?;
            if field == Field::Name {
                // A kernel name is matched as the device path Ironic compares (`/dev/sda`).
                for v in &mut values {
                    if !v.starts_with("/dev/") && matches!(op, Op::Eq | Op::Ne | Op::Or) {
                        *v = format!("/dev/{v}");
                    }
                }
            }
            Ok(Test::Text(field, op, values))
        }
    }
}

/// A set of root device hints: a disk matches when it satisfies every one.
#[derive(Debug, Clone, PartialEq)]
pub struct RootDeviceHints {
    /// As the operator wrote them (sent to the agent as they are).
    written: serde_json::Map<String, serde_json::Value>,
    tests: Vec<Test>,
}

impl RootDeviceHints {
    /// Parses hints from a JSON object, as an inventory entry's `Disk` holds them.
    pub fn parse(object: &serde_json::Map<String, serde_json::Value>) -> Result<Self, HintError> {
        if object.is_empty() {
            return Err(hint_error(
                "",
                format!(
                    "root device hints must name at least one of {}",
                    names().join(", ")
                ),
            ));
        }
        let mut tests = Vec::new();
        for (hint, value) in object {
            let field = Field::named(hint).ok_or_else(|| {
                hint_error(
                    hint,
                    format!("is not a hint; the hints are {}", names().join(", ")),
                )
            })?;
            tests.push(parse_test(hint, field, value)?);
        }
        Ok(RootDeviceHints {
            written: object.clone(),
            tests,
        })
    }

    /// Parses hints from the JSON text of an installation request.
    pub fn from_json(text: &str) -> Result<Self, HintError> {
        match serde_json::from_str::<serde_json::Value>(text) {
            Ok(serde_json::Value::Object(object)) => RootDeviceHints::parse(&object),
            Ok(other) => Err(hint_error(
                "",
                format!("root device hints {other} are not an object"),
            )),
            Err(e) => Err(hint_error(
                "",
                format!("root device hints are not JSON: {e}"),
            )),
        }
    }

    /// Hints that name `disk` by its identity, its serial and WWN (where it has them), which
    /// a reboot does not change as it may change the disk's kernel name: Shepherd pins the
    /// disk an agent chose with them, so that a retry writes that very disk. `None` for a disk
    /// with neither.
    pub fn identifying(disk: &DiskFacts) -> Option<RootDeviceHints> {
        let mut written = serde_json::Map::new();
        for (hint, value) in [("serial", &disk.serial), ("wwn", &disk.wwn)] {
            if !value.trim().is_empty() {
                written.insert(hint.into(), format!("s== {}", value.trim()).into());
            }
        }
        if written.is_empty() {
            return None;
        }
        RootDeviceHints::parse(&written).ok()
    }

    /// The hints as JSON text, as the operator wrote them.
    pub fn to_json(&self) -> String {
        serde_json::Value::Object(self.written.clone()).to_string()
    }

    /// Whether `disk` satisfies every hint.
    pub fn matches(&self, disk: &DiskFacts) -> bool {
        self.tests.iter().all(|t| passes(t, disk))
    }
}

impl fmt::Display for RootDeviceHints {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the hints {}", self.to_json())
    }
}

fn names() -> Vec<&'static str> {
    Field::NAMES.to_vec()
}

fn passes(test: &Test, disk: &DiskFacts) -> bool {
    match test {
        Test::Rotational(want) => disk.rotational == *want,
        Test::Size(op, sizes) => {
            let gib = disk.size_bytes as f64 / (1u64 << 30) as f64;
            op.holds(&gib, &sizes[0], || sizes.contains(&gib))
        }
        Test::Text(field, op, values) => {
            let have = field.text(disk);
            // A disk without the fact matches no hint on it (Ironic skips such a disk).
            if have.is_empty() {
                return false;
            }
            if *op == Op::In {
                return have.contains(values[0].as_str());
            }
            op.holds(have.as_str(), values[0].as_str(), || values.contains(&have))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn disk() -> DiskFacts {
        DiskFacts {
            name: "/dev/sdb".into(),
            size_bytes: 480 << 30,
            serial: "S3YJNX0K".into(),
            wwn: "0x5002538e40a1b2c3".into(),
            wwn_with_extension: "0x5002538e40a1b2c3".into(),
            wwn_vendor_extension: String::new(),
            model: "Samsung SSD 860 ".into(),
            vendor: "ATA".into(),
            hctl: "1:0:0:0".into(),
            by_path: "/dev/disk/by-path/pci-0000:00:17.0-ata-2".into(),
            rotational: false,
        }
    }

    fn hints(json: &str) -> Result<RootDeviceHints, HintError> {
        RootDeviceHints::from_json(json)
    }

    #[test]
    fn a_disk_is_pinned_by_its_serial_and_wwn_and_by_nothing_else() {
        let chosen = disk();
        let pin = RootDeviceHints::identifying(&chosen).unwrap();
        assert_eq!(
            pin.to_json(),
            r#"{"serial":"s== S3YJNX0K","wwn":"s== 0x5002538e40a1b2c3"}"#
        );
        assert!(pin.matches(&chosen));
        // Renamed by a reboot, it is still the disk pinned; another of its model is not.
        let renamed = DiskFacts {
            name: "/dev/sda".into(),
            ..disk()
        };
        assert!(pin.matches(&renamed));
        let sibling = DiskFacts {
            serial: "S3YJNX0L".into(),
            wwn: "0x5002538e40a1b2c4".into(),
            ..disk()
        };
        assert!(!pin.matches(&sibling));
        let only_serial = DiskFacts {
            wwn: String::new(),
            ..disk()
        };
        let pin = RootDeviceHints::identifying(&only_serial).unwrap();
        assert_eq!(pin.to_json(), r#"{"serial":"s== S3YJNX0K"}"#);
        let anonymous = DiskFacts {
            serial: String::new(),
            ..only_serial
        };
        assert_eq!(RootDeviceHints::identifying(&anonymous), None);
    }

    #[test]
    fn ironics_operators_match_as_ironic_matches_them() {
        let cases: [(&str, bool); 28] = [
            (r#"{"serial": "S3YJNX0K"}"#, true),
            (r#"{"serial": "s3yjnx0k"}"#, true),
            (r#"{"serial": "s== S3YJNX0K"}"#, true),
            (r#"{"serial": "s!= S3YJNX0K"}"#, false),
            (r#"{"serial": "S3YJNX0"}"#, false),
            (r#"{"serial": "<in> YJNX"}"#, true),
            (r#"{"serial": "<or> AAA <or> s3yjnx0k"}"#, true),
            (r#"{"serial": "<or> AAA <or> BBB"}"#, false),
            (r#"{"model": "samsung ssd 860"}"#, true),
            (r#"{"model": "<in> SSD"}"#, true),
            (r#"{"model": "s>= samsung"}"#, true),
            (r#"{"model": "s< samsung"}"#, false),
            (r#"{"vendor": "ata", "rotational": false}"#, true),
            (r#"{"rotational": true}"#, false),
            (r#"{"rotational": "no"}"#, true),
            (r#"{"size": 480}"#, true),
            (r#"{"size": "480"}"#, true),
            (r#"{"size": 479}"#, false),
            (r#"{"size": ">= 400"}"#, true),
            (r#"{"size": "= 400"}"#, true),
            (r#"{"size": "<= 400"}"#, false),
            (r#"{"size": "> 480"}"#, false),
            (r#"{"size": "<or> 240 <or> 480"}"#, true),
            (r#"{"wwn": "0x5002538E40A1B2C3"}"#, true),
            (r#"{"wwn_vendor_extension": "0x1"}"#, false),
            (r#"{"name": "sdb"}"#, true),
            (r#"{"name": "/dev/sdb", "hctl": "1:0:0:0"}"#, true),
            (
                r#"{"by_path": "/dev/disk/by-path/pci-0000:00:17.0-ata-2", "serial": "x"}"#,
                false,
            ),
        ];
        for (json, want) in cases {
            let parsed = hints(json).unwrap_or_else(|e| panic!("{json}: {e}"));
            assert_eq!(parsed.matches(&disk()), want, "{json}");
        }
    }

    #[test]
    fn every_named_hint_is_known() {
        for name in Field::NAMES {
            assert!(Field::named(name).is_some(), "{name}");
        }
    }

    #[test]
    fn a_size_is_in_gib_and_not_rounded() {
        let mut d = disk();
        d.size_bytes = (10 << 30) + 512;
        assert!(!hints(r#"{"size": 10}"#).unwrap().matches(&d));
        assert!(hints(r#"{"size": ">= 10"}"#).unwrap().matches(&d));
    }

    #[test]
    fn a_disk_without_the_fact_matches_no_hint_on_it() {
        let mut d = disk();
        d.serial.clear();
        assert!(!hints(r#"{"serial": "s!= X"}"#).unwrap().matches(&d));
    }

    #[test]
    fn hints_that_cannot_be_used_are_said_clearly() {
        let cases = [
            ("{}", "name at least one of"),
            (r#"{"colour": "red"}"#, "colour: is not a hint"),
            (r#"{"serial": ""}"#, "serial: is empty"),
            (r#"{"serial": 5}"#, "serial: 5 is not text"),
            (r#"{"serial": ">= 5"}"#, "operator >= does not apply"),
            (r#"{"size": "s== 5"}"#, "operator s== does not apply"),
            (r#"{"size": 0}"#, "not a positive whole number"),
            (r#"{"size": "ten"}"#, "not a positive whole number"),
            (r#"{"rotational": "maybe"}"#, "not true or false"),
            (r#"{"serial": "<or>"}"#, "<or> names no value"),
            (r#"{"model": "<in>"}"#, "<in> names no value"),
            ("[1]", "are not an object"),
            ("{", "are not JSON"),
        ];
        for (json, want) in cases {
            let err = hints(json).unwrap_err().to_string();
            assert!(err.contains(want), "{json}: {err}");
        }
    }

    #[test]
    fn hints_go_on_the_wire_as_written() {
        let h = hints(r#"{"serial": "S== Abc"}"#).unwrap();
        assert_eq!(RootDeviceHints::from_json(&h.to_json()).unwrap(), h);
        assert_eq!(h.to_string(), r#"the hints {"serial":"S== Abc"}"#);
    }
}
