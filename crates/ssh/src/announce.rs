//! Remote commands as the shell runs them: words quoted for it, and a command that announces
//! its process id, so that one which overruns its timeout can be killed on the machine.
//! Closing the channel does not end it: sshd sends no signal when a session without a
//! terminal closes, and it refuses SSH's own `signal` request for root's sessions (they run
//! without privilege separation). So the command first writes its process id on a line of its
//! own and then becomes the command (`exec`, same process); sshd made that process a session
//! and group leader, so killing the group over a second channel ends the command and
//! everything it started.

use std::borrow::Cow;

/// Quotes `s` as one word for the remote shell (sshd runs commands through the user's shell).
pub fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// `command` as it is sent: `echo $$` first, then `command` in its place, run by `sh` (so
/// that a command of several statements is one process to `exec`).
pub(crate) fn announcing(command: &str) -> String {
    format!("echo $$; exec sh -c {}", shell_quote(command))
}

/// The command that kills process group `pid` with everything in it.
pub(crate) fn kill_group_command(pid: u32) -> String {
    format!("kill -s KILL -- -{pid}")
}

/// Longest first line taken for a process id (a pid has at most 10 digits).
const LONGEST_PID_LINE: usize = 16;

/// Splits the announced process id off the front of a command's stdout.
#[derive(Debug, Default)]
pub(crate) struct PidLine {
    line: Vec<u8>,
    done: bool,
    pid: Option<u32>,
}

impl PidLine {
    /// The process id, once its line was read.
    pub(crate) fn pid(&self) -> Option<u32> {
        self.pid
    }

    /// What was held back as a possible pid line when the output ended without one (a server
    /// that is not a shell answers what it likes): the command's output after all.
    pub(crate) fn rest(&mut self) -> Vec<u8> {
        self.done = true;
        std::mem::take(&mut self.line)
    }

    /// What of `data` (the next stdout bytes) is the command's own output. A first line that
    /// is no process id (a login script that writes to stdout, say) is given back as output.
    pub(crate) fn output<'d>(&mut self, data: &'d [u8]) -> Cow<'d, [u8]> {
        if self.done {
            return Cow::Borrowed(data);
        }
        let (head, rest) = match data.iter().position(|&b| b == b'\n') {
            Some(i) => (&data[..i], Some(&data[i + 1..])),
            None => (data, None),
        };
        self.line.extend_from_slice(head);
        let Some(rest) = rest else {
            if self.line.len() <= LONGEST_PID_LINE {
                return Cow::Borrowed(&[]);
            }
            // Too long for a pid: not ours.
            self.done = true;
            return Cow::Owned(std::mem::take(&mut self.line));
        };
        self.done = true;
        let line = std::mem::take(&mut self.line);
        self.pid = std::str::from_utf8(&line)
            .ok()
            .and_then(|s| s.trim().parse().ok());
        if self.pid.is_some() {
            Cow::Borrowed(rest)
        } else {
            let mut all = line;
            all.push(b'\n');
            all.extend_from_slice(rest);
            Cow::Owned(all)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(chunks: &[&[u8]]) -> (Option<u32>, Vec<u8>) {
        let mut p = PidLine::default();
        let mut out = Vec::new();
        for c in chunks {
            out.extend_from_slice(&p.output(c));
        }
        out.extend_from_slice(&p.rest());
        (p.pid(), out)
    }

    #[test]
    fn the_pid_line_is_taken_off_however_the_output_is_cut() {
        assert_eq!(split(&[b"4242\nhello"]), (Some(4242), b"hello".to_vec()));
        assert_eq!(
            split(&[b"42", b"42", b"\n", b"he", b"llo\n"]),
            (Some(4242), b"hello\n".to_vec())
        );
        assert_eq!(split(&[b"7\n"]), (Some(7), vec![]));
        // Binary output after the pid line is the command's, byte for byte.
        assert_eq!(
            split(&[b"9\n\x00\n\xff", b"\n"]),
            (Some(9), b"\x00\n\xff\n".to_vec())
        );
    }

    #[test]
    fn a_first_line_that_is_no_pid_stays_output() {
        assert_eq!(
            split(&[b"welcome\n4242\nx"]),
            (None, b"welcome\n4242\nx".to_vec())
        );
        // Output that ends before a line ends is output too.
        assert_eq!(split(&[b"ok"]), (None, b"ok".to_vec()));
        let long = [b'a'; 40];
        assert_eq!(
            split(&[&long, b"\nx"]),
            (None, [&long[..], b"\nx"].concat())
        );
    }

    #[test]
    fn the_command_is_quoted_whole() {
        assert_eq!(
            announcing("sleep 1; echo 'hi'"),
            r"echo $$; exec sh -c 'sleep 1; echo '\''hi'\'''"
        );
        assert_eq!(kill_group_command(17), "kill -s KILL -- -17");
    }
}
