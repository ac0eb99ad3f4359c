//! NVIDIA's control program run against a share's pipe: one command in, its answer out,
//! bounded in time, with what it printed kept for the error.

use std::{
    io::{Read, Write},
    path::Path,
    process::{Command, Stdio},
    time::Instant,
};

use super::{MpsDaemons, POLL, check_control_socket, check_listener, check_shared_dir, parse_pids};
use crate::error::GpuError;

impl MpsDaemons {
    pub(super) fn servers(&self, pipe: &Path) -> Result<Vec<u32>, GpuError> {
        parse_pids(&self.command(pipe, "get_server_list")?, "get_server_list")
    }

    /// One control command; its standard output on success.
    pub(super) fn command(&self, pipe: &Path, cmd: &str) -> Result<String, GpuError> {
        let out = self.run(pipe, cmd)?;
        if !out.success {
            return Err(GpuError::Transient(format!(
                "MPS control `{cmd}` in {}: {}",
                pipe.display(),
                out.describe()
            )));
        }
        Ok(out.stdout)
    }

    pub(super) fn run(&self, pipe: &Path, input: &str) -> Result<Output, GpuError> {
        // The answer is only as good as the socket it came through.
        check_shared_dir(pipe)?;
        check_control_socket(pipe)?;
        if let Some(daemon) = pipe.parent().and_then(|dir| self.recorded_daemon(dir)) {
            check_listener(pipe, daemon.pid)?;
        }
        self.spawn(&self.cfg.control, pipe, None, &[], Some(input))
    }
    pub(super) fn spawn(
        &self,
        program: &Path,
        pipe: &Path,
        daemon: Option<(&str, &Path)>,
        args: &[&str],
        input: Option<&str>,
    ) -> Result<Output, GpuError> {
        let mut c = Command::new(program);
        c.args(args)
            .env("CUDA_MPS_PIPE_DIRECTORY", pipe)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some((uuid, log)) = daemon {
            c.env("CUDA_VISIBLE_DEVICES", uuid)
                .env("CUDA_MPS_LOG_DIRECTORY", log)
                // The daemon must not hold the agent's pipes open after `-d` returns.
                .stdout(Stdio::null())
                .stderr(Stdio::null());
        }
        let what = || format!("{} {}", program.display(), args.join(" "));
        let mut child = c
            .spawn()
            .map_err(|e| GpuError::Unavailable(format!("cannot run {}: {e}", program.display())))?;
        if let Some(mut stdin) = child.stdin.take() {
            let line = input.map(|s| format!("{s}\n")).unwrap_or_default();
            // A control program that exits before reading is reported by its status.
            let _ = stdin.write_all(line.as_bytes());
        }
        let deadline = Instant::now() + self.cfg.timeout;
        let status = loop {
            match child.try_wait() {
                Ok(Some(s)) => break s,
                Ok(None) if Instant::now() >= deadline => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(GpuError::Transient(format!(
                        "{} did not answer within {:?}",
                        what(),
                        self.cfg.timeout
                    )));
                }
                Ok(None) => std::thread::sleep(POLL),
                Err(e) => return Err(GpuError::Internal(format!("waiting for {}: {e}", what()))),
            }
        };
        // The answers are a line or a few PIDs, far below a pipe's buffer, so reading
        // after the exit cannot have blocked the program.
        let mut stdout = String::new();
        let mut stderr = String::new();
        if let Some(mut s) = child.stdout.take() {
            let _ = s.read_to_string(&mut stdout);
        }
        if let Some(mut s) = child.stderr.take() {
            let _ = s.read_to_string(&mut stderr);
        }
        Ok(Output {
            success: status.success(),
            code: status.code(),
            stdout,
            stderr,
        })
    }
}

pub(super) struct Output {
    pub(super) success: bool,
    pub(super) code: Option<i32>,
    pub(super) stdout: String,
    pub(super) stderr: String,
}

impl Output {
    pub(super) fn describe(&self) -> String {
        let code = self.code.map_or("a signal".to_string(), |c| c.to_string());
        format!("exit {code}: {} {}", self.stdout.trim(), self.stderr.trim())
            .trim_end()
            .to_string()
    }
}
