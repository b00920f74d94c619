//! Each skinny-product kernel's bandwidth against the machine's read bandwidth, in one run.
//!
//! A batch-1 decode step reads every weight once, so a kernel is at the memory limit when
//! its weight bytes per second equal what a plain reduction over a buffer larger than the
//! caches reaches. This bench measures both, side by side, alternating formats over
//! `--repeats` rounds, on the weights of one Qwen3-0.6B-shaped decode token (8 layers of
//! q/k/v, o, gate/up and down projections, and the 151,936 x 1024 LM head): float32,
//! int8 with one scale per output channel (online `quantization="int8"`), int8 in groups
//! of 32 (GGUF Q8_0) and int4 in groups of 128 with biases (online int4, GPTQ, AWQ).
//!
//! The engine runs the kernels on PyTorch's OpenMP team; so that the bench does too, it
//! loads the system's libgomp before the first call when there is one (and says so).
//!
//! Usage: `cargo bench -p pyengine-kernels --bench gemv -- [--json] [--threads N]
//! [--rows N] [--repeats N] [--formats f32,int8,q8_0,int4]`

use std::time::Instant;

use pyengine_kernels::{gemv, Weight, WeightData};

/// (out_features, in_features) of one decoder layer's merged projections, then the head.
const LAYER: [(usize, usize); 4] = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)];
const LAYERS: usize = 8;
const HEAD: (usize, usize) = (151_936, 1024);

struct Options {
    json: bool,
    threads: usize,
    rows: usize,
    repeats: usize,
    formats: Vec<String>,
    /// One 1024 x 1024 weight, repeated: in the caches, so the kernel's compute alone.
    cached: bool,
}

fn options() -> Options {
    let mut options = Options {
        json: false,
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        rows: 1,
        repeats: 5,
        formats: ["f32", "int8", "q8_0", "int4"].map(String::from).to_vec(),
        cached: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| panic!("{arg} needs a value"));
        match arg.as_str() {
            "--json" => options.json = true,
            "--threads" => options.threads = value().parse().expect("--threads N"),
            "--rows" => options.rows = value().parse().expect("--rows N"),
            "--repeats" => options.repeats = value().parse().expect("--repeats N"),
            "--formats" => options.formats = value().split(',').map(String::from).collect(),
            "--cached" => options.cached = true,
            "--bench" => {}
            other => panic!("unknown argument {other}"),
        }
    }
    options
}

/// Loads libgomp (as PyTorch would have) so that the kernels use an OpenMP team.
fn load_openmp() -> bool {
    // SAFETY: dlopen of a system library by name; the handle is kept for the process.
    unsafe { !libc::dlopen(c"libgomp.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL).is_null() }
}

/// Pseudo-random bytes (no dependency).
fn bytes(seed: u64, count: usize) -> Vec<u8> {
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
    (0..count)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 56) as u8
        })
        .collect()
}

/// One matrix of the token in one format: its integers or floats, scales and biases.
struct Matrix {
    n: usize,
    k: usize,
    group: usize,
    floats: Vec<f32>,
    int8: Vec<i8>,
    int4: Vec<u8>,
    scales: Vec<f32>,
    biases: Option<Vec<f32>>,
}

impl Matrix {
    fn new(format: &str, n: usize, k: usize, seed: u64) -> Matrix {
        let group = match format {
            "f32" | "int8" => k,
            "q8_0" => 32,
            "int4" => 128,
            other => panic!("unknown format {other} (f32, int8, q8_0, int4)"),
        };
        let raw = bytes(seed, if format == "int4" { n * k / 2 } else { n * k });
        let mut matrix = Matrix {
            n,
            k,
            group,
            floats: Vec::new(),
            int8: Vec::new(),
            int4: Vec::new(),
            scales: Vec::new(),
            biases: None,
        };
        match format {
            "f32" => matrix.floats = raw.iter().map(|&b| (b as f32 - 128.0) / 128.0).collect(),
            "int4" => {
                matrix.int4 = raw;
                matrix.biases = Some(vec![-0.05; n * k / group]);
            }
            _ => matrix.int8 = raw.into_iter().map(|b| b as i8).collect(),
        }
        if format != "f32" {
            matrix.scales = vec![0.01; n * k / group];
        }
        matrix
    }

    fn weight(&self) -> Weight<'_> {
        let data = if !self.floats.is_empty() {
            WeightData::F32(&self.floats)
        } else if !self.int4.is_empty() {
            WeightData::Int4(&self.int4)
        } else {
            WeightData::Int8(&self.int8)
        };
        Weight {
            data,
            scales: (!self.scales.is_empty()).then_some(&self.scales[..]),
            biases: self.biases.as_deref(),
            out_features: self.n,
            in_features: self.k,
            group_size: self.group,
        }
    }

    /// Bytes a product reads: the weight, its scales and biases.
    fn bytes(&self) -> usize {
        self.floats.len() * 4
            + self.int8.len()
            + self.int4.len()
            + self.scales.len() * 4
            + self.biases.as_ref().map_or(0, |b| b.len() * 4)
    }
}

fn token(format: &str, cached: bool) -> Vec<Matrix> {
    if cached {
        return vec![Matrix::new(format, 1024, 1024, 0)];
    }
    let mut matrices = Vec::new();
    for layer in 0..LAYERS {
        for (i, &(n, k)) in LAYER.iter().enumerate() {
            matrices.push(Matrix::new(format, n, k, (layer * 4 + i) as u64));
        }
    }
    matrices.push(Matrix::new(format, HEAD.0, HEAD.1, 99));
    matrices
}

/// The process's CPU seconds so far (every thread's).
fn cpu_seconds() -> f64 {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut now) };
    now.tv_sec as f64 + now.tv_nsec as f64 * 1e-9
}

/// A pass's wall seconds and its CPU seconds per thread (best of `tries` each): on a
/// shared machine the second is what the pass takes when its threads have their cores.
fn time_token(matrices: &[Matrix], rows: usize, threads: usize, tries: usize) -> (f64, f64) {
    let widest = matrices.iter().map(|m| m.k).max().unwrap_or(0);
    let tallest = matrices.iter().map(|m| m.n).max().unwrap_or(0);
    let x: Vec<f32> = bytes(7, rows * widest).iter().map(|&b| b as f32 / 256.0).collect();
    let mut out = vec![0f32; rows * tallest];
    let (mut wall, mut cpu) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..tries {
        let (start, start_cpu) = (Instant::now(), cpu_seconds());
        for matrix in matrices {
            let (n, k) = (matrix.n, matrix.k);
            gemv(matrix.weight(), &x[..rows * k], rows, &mut out[..rows * n], threads).expect("valid shapes");
        }
        wall = wall.min(start.elapsed().as_secs_f64());
        cpu = cpu.min((cpu_seconds() - start_cpu) / threads as f64);
    }
    std::hint::black_box(&out);
    (wall, cpu)
}

/// Bytes per second of a plain sum over 1 GiB of float32 split over `threads` (best of 5),
/// by the wall clock and by CPU time per thread.
fn read_bandwidth(threads: usize) -> (f64, f64) {
    let buffer: Vec<f32> = vec![1.0; (1 << 30) / 4];
    let parts = threads.max(1);
    let (mut wall, mut cpu) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..5 {
        let (start, start_cpu) = (Instant::now(), cpu_seconds());
        let sums: Vec<f32> = std::thread::scope(|scope| {
            let handles: Vec<_> = buffer
                .chunks(buffer.len().div_ceil(parts))
                .map(|part| {
                    scope.spawn(move || {
                        let mut lanes = [0f32; 16];
                        for chunk in part.chunks_exact(16) {
                            for (lane, v) in lanes.iter_mut().zip(chunk) {
                                *lane += v;
                            }
                        }
                        lanes.iter().sum::<f32>()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("sum thread")).collect()
        });
        std::hint::black_box(sums);
        wall = wall.min(start.elapsed().as_secs_f64());
        cpu = cpu.min((cpu_seconds() - start_cpu) / parts as f64);
    }
    ((1u64 << 30) as f64 / wall, (1u64 << 30) as f64 / cpu)
}

fn main() {
    let options = options();
    let openmp = load_openmp();
    let (bandwidth, bandwidth_cpu) = read_bandwidth(options.threads);
    let tokens: Vec<(String, Vec<Matrix>)> =
        options.formats.iter().map(|f| (f.clone(), token(f, options.cached))).collect();
    let mut best = vec![(f64::INFINITY, f64::INFINITY); tokens.len()];
    let tries = if options.cached { 200 } else { 1 };
    for _ in 0..options.repeats {
        for (slot, (_, matrices)) in best.iter_mut().zip(&tokens) {
            let (wall, cpu) = time_token(matrices, options.rows, options.threads, tries);
            *slot = (slot.0.min(wall), slot.1.min(cpu));
        }
    }
    let (after, after_cpu) = read_bandwidth(options.threads);
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load = load.split_whitespace().next().unwrap_or("?").to_string();
    let mut entries = Vec::new();
    for ((format, matrices), (wall, cpu)) in tokens.iter().zip(&best) {
        let read: usize = matrices.iter().map(Matrix::bytes).sum();
        let (gb_s, cpu_gb_s) = (read as f64 / wall / 1e9, read as f64 / cpu / 1e9);
        if !options.json {
            println!(
                "{format:5} {:7.1} MB/token  wall {:7.2} ms {gb_s:6.2} GB/s ({:.2} of read)  \
                 CPU time {:7.2} ms {cpu_gb_s:6.2} GB/s ({:.2} of read by CPU time)",
                read as f64 / 1e6,
                wall * 1e3,
                gb_s * 1e9 / bandwidth,
                cpu * 1e3,
                cpu_gb_s * 1e9 / bandwidth_cpu
            );
        }
        entries.push(format!(
            "\"{format}\": {{\"bytes_per_token\": {read}, \"ms\": {:.3}, \"gb_s\": {gb_s:.2}, \
             \"fraction_of_read_bandwidth\": {:.3}, \"cpu_ms\": {:.3}, \"cpu_gb_s\": {cpu_gb_s:.2}, \
             \"cpu_fraction_of_read_bandwidth\": {:.3}}}",
            wall * 1e3,
            gb_s * 1e9 / bandwidth,
            cpu * 1e3,
            cpu_gb_s * 1e9 / bandwidth_cpu
        ));
    }
    if options.json {
        println!(
            "{{\"threads\": {}, \"rows\": {}, \"cached\": {}, \"openmp\": {openmp}, \"load_average\": {load}, \
             \"read_bandwidth_gb_s\": {:.2}, \"read_bandwidth_after_gb_s\": {:.2}, \
             \"read_bandwidth_cpu_gb_s\": {:.2}, \"read_bandwidth_cpu_after_gb_s\": {:.2}, {}}}",
            options.threads,
            options.rows,
            options.cached,
            bandwidth / 1e9,
            after / 1e9,
            bandwidth_cpu / 1e9,
            after_cpu / 1e9,
            entries.join(", ")
        );
    } else {
        println!(
            "read bandwidth {:.2} GB/s (after: {:.2}), by CPU time {:.2} (after: {:.2}); {} threads, {} rows, \
             OpenMP team: {openmp}, load {load}",
            bandwidth / 1e9,
            after / 1e9,
            bandwidth_cpu / 1e9,
            after_cpu / 1e9,
            options.threads,
            options.rows
        );
    }
}
