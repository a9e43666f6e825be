//! Runs the parts of a `small_gemm` call on the OpenMP threads that torch already uses.
//!
//! Why not a pool of our own: torch's CPU ops run on libgomp's team, whose idle threads spin
//! for a while after every parallel region. A second pool on the same cores fights them: one
//! side's spinning thread takes the core the other side's job waits for, and a time slice is
//! milliseconds (measured: a 2-thread own pool made decoding 3x slower). Joining libgomp's team
//! with `GOMP_parallel`, as torch's own `at::parallel_for` does, shares the threads instead.
//!
//! The library is the one already loaded into the process (torch's `libgomp.so.1`, found with
//! `RTLD_NOLOAD`, or any loaded object whose path contains "libgomp"); when there is none (e.g.
//! plain `cargo test`, no torch), parts run one after another on the calling thread.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;

type ParallelFn = unsafe extern "C" fn(extern "C" fn(*mut c_void), *mut c_void, c_uint, c_uint);
type IntFn = unsafe extern "C" fn() -> c_int;

struct Gomp {
    parallel: ParallelFn,
    thread_num: IntFn,
    num_threads: IntFn,
}

static GOMP: OnceLock<Option<Gomp>> = OnceLock::new();

/// What one team member runs: parts i, i + team, i + 2 * team, ... (the team may be smaller
/// than asked for, e.g. inside another parallel region).
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    parts: usize,
    gomp: &'a Gomp,
}

extern "C" fn member(data: *mut c_void) {
    // SAFETY: `data` is the &Job that `run` passed to GOMP_parallel, alive until it returns.
    let job = unsafe { &*(data as *const Job) };
    let (me, team) = unsafe { ((job.gomp.thread_num)(), (job.gomp.num_threads)()) };
    let (me, team) = (me.max(0) as usize, team.max(1) as usize);
    let mut part = me;
    while part < job.parts {
        (job.f)(part);
        part += team;
    }
}

/// Runs f(0), ..., f(parts - 1) across up to `parts` threads of libgomp's team and returns when
/// all have run; without a loaded libgomp (or for one part), on the calling thread in order.
pub fn run(parts: usize, f: &(dyn Fn(usize) + Sync)) {
    match GOMP.get_or_init(find_gomp) {
        Some(gomp) if parts > 1 => {
            let job = Job { f, parts, gomp };
            // SAFETY: GOMP_parallel runs `member` on the calling thread and the team and
            // returns after all of them finished, so `job` outlives every use.
            unsafe {
                (gomp.parallel)(
                    member,
                    &job as *const Job as *mut c_void,
                    parts as c_uint,
                    0,
                )
            };
        }
        _ => (0..parts).for_each(f),
    }
}

/// Runs f(0), ..., f(tasks - 1) on up to `threads` threads of libgomp's team (`run`), each
/// thread taking the next task not yet taken: tasks of uneven cost balance out, and a team is
/// never asked for more threads than `threads` (libgomp starts as many as a region asks for).
pub fn run_tasks(tasks: usize, threads: usize, f: &(dyn Fn(usize) + Sync)) {
    let next = std::sync::atomic::AtomicUsize::new(0);
    run(threads.clamp(1, tasks.max(1)), &|_| loop {
        let task = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if task >= tasks {
            break;
        }
        f(task);
    });
}

/// Whether parts run in parallel (a libgomp is loaded); for tests and diagnostics.
pub fn parallel() -> bool {
    GOMP.get_or_init(find_gomp).is_some()
}

const RTLD_NOW: c_int = 2;
const RTLD_NOLOAD: c_int = 4;

extern "C" {
    fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
    fn dl_iterate_phdr(
        callback: extern "C" fn(*mut DlPhdrInfo, usize, *mut c_void) -> c_int,
        data: *mut c_void,
    ) -> c_int;
}

/// The head of glibc's `struct dl_phdr_info` (only the fields read here).
#[repr(C)]
struct DlPhdrInfo {
    addr: usize,
    name: *const c_char,
}

extern "C" fn collect_gomp(info: *mut DlPhdrInfo, _size: usize, data: *mut c_void) -> c_int {
    // SAFETY: glibc passes a valid info whose name is a C string (maybe empty or null).
    let name = unsafe { (*info).name };
    if name.is_null() {
        return 0;
    }
    let path = unsafe { CStr::from_ptr(name) };
    let Ok(text) = path.to_str() else { return 0 };
    let file = text.rsplit('/').next().unwrap_or(text);
    if file.starts_with("libgomp") {
        // SAFETY: `data` is the &mut Option<CString> passed by find_gomp.
        let out = unsafe { &mut *(data as *mut Option<std::ffi::CString>) };
        *out = Some(path.to_owned());
        return 1;
    }
    0
}

fn find_gomp() -> Option<Gomp> {
    // SAFETY: dlopen with RTLD_NOLOAD only returns handles of libraries already loaded;
    // dlsym results are checked for null before being used as the documented signatures.
    unsafe {
        let mut handle = dlopen(c"libgomp.so.1".as_ptr(), RTLD_NOW | RTLD_NOLOAD);
        if handle.is_null() {
            let mut found: Option<std::ffi::CString> = None;
            dl_iterate_phdr(collect_gomp, &mut found as *mut _ as *mut c_void);
            if let Some(path) = found {
                handle = dlopen(path.as_ptr(), RTLD_NOW | RTLD_NOLOAD);
            }
        }
        if handle.is_null() {
            return None;
        }
        let parallel = dlsym(handle, c"GOMP_parallel".as_ptr());
        let thread_num = dlsym(handle, c"omp_get_thread_num".as_ptr());
        let num_threads = dlsym(handle, c"omp_get_num_threads".as_ptr());
        if parallel.is_null() || thread_num.is_null() || num_threads.is_null() {
            return None;
        }
        Some(Gomp {
            parallel: std::mem::transmute::<*mut c_void, ParallelFn>(parallel),
            thread_num: std::mem::transmute::<*mut c_void, IntFn>(thread_num),
            num_threads: std::mem::transmute::<*mut c_void, IntFn>(num_threads),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_part_runs_exactly_once() {
        for parts in 1..=5 {
            let hits: Vec<AtomicUsize> = (0..parts).map(|_| AtomicUsize::new(0)).collect();
            run(parts, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "parts {parts}"
            );
        }
    }

    #[test]
    fn every_task_runs_exactly_once_whatever_the_threads() {
        for (tasks, threads) in [(0, 2), (1, 4), (7, 2), (40, 3)] {
            let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
            run_tasks(tasks, threads, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
    }
}
