//! PostgreSQL's processes seen from /proc: their CPU time, the machine's CPU
//! ticks, and pinning a postmaster with its children to one core.

use crate::environment::BoxError;
use crate::ws::server::{proc_cpu_s, proc_stat};

/// The processes whose parent is `pm` (a postmaster's backends and helpers).
fn children(pm: i32) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return vec![] };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()))
        .filter(|&pid| proc_stat(pid).is_some_and(|f| f.get(1).and_then(|p| p.parse::<i32>().ok()) == Some(pm)))
        .collect()
}

/// CPU seconds of the postmaster `pm` and its children so far: the live ones'
/// utime+stime, and the reaped ones' through the postmaster's cutime+cstime.
pub fn postgres_cpu_s(pm: i32) -> f64 {
    // SAFETY: sysconf has no preconditions.
    let tick = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let own = proc_stat(pm)
        .map(|f| (11..=14).map(|i| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)).sum::<u64>())
        .unwrap_or(0) as f64
        / tick;
    own + children(pm).into_iter().map(proc_cpu_s).sum::<f64>()
}

/// Busy and total CPU ticks of the machine (the `cpu` line of /proc/stat;
/// idle and iowait count as not busy).
pub fn cpu_ticks() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let ticks: Vec<u64> = stat
        .lines()
        .next()
        .and_then(|l| l.strip_prefix("cpu "))
        .map(|l| l.split_whitespace().filter_map(|v| v.parse().ok()).collect())
        .unwrap_or_default();
    let all: u64 = ticks.iter().take(8).sum();
    let idle = ticks.get(3).copied().unwrap_or(0) + ticks.get(4).copied().unwrap_or(0);
    (all - idle, all)
}

/// Pins the postmaster `pm` and its children to the first core this process
/// may use (`one_core`), or lets them use all of this process's cores again.
/// The postmaster first, so a backend forked meanwhile inherits the mask.
pub fn pin(pm: i32, one_core: bool) -> Result<(), BoxError> {
    // SAFETY: cpu_set_t is plain data; sched_getaffinity fills the set we own.
    let mut ours: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let size = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: as above.
    if unsafe { libc::sched_getaffinity(0, size, &mut ours) } != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    let mask = if one_core {
        // SAFETY: CPU_ISSET/CPU_SET only index into the set we own.
        let first = (0..libc::CPU_SETSIZE as usize).find(|&c| unsafe { libc::CPU_ISSET(c, &ours) });
        // SAFETY: as above.
        let mut one: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        unsafe { libc::CPU_SET(first.ok_or("this process may run on no core")?, &mut one) };
        one
    } else {
        ours
    };
    for pid in std::iter::once(pm).chain(children(pm)) {
        // SAFETY: sched_setaffinity reads the set we own; as root it may set any process's mask.
        if unsafe { libc::sched_setaffinity(pid, size, &mask) } != 0 {
            let e = std::io::Error::last_os_error();
            // A child that exited meanwhile has nothing left to pin.
            if pid == pm || e.raw_os_error() != Some(libc::ESRCH) {
                return Err(format!("pin PostgreSQL process {pid}: {e}").into());
            }
        }
    }
    Ok(())
}
