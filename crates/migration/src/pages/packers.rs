//! Packers: threads that compress one sender's page frames while the sender gathers the next
//! batch and writes the finished ones (`--migration-threads`). Frames leave in the order they
//! were gathered, so a page's newer copy still arrives after its older one.
//!
//! Written here rather than taken from a thread-pool crate: all it needs is "run these jobs on
//! a few threads, hand results back in submission order", which a shared job channel and one
//! reply channel per job give in a few lines, with no work-stealing runtime to configure.

use std::collections::VecDeque;
use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::cpu::{CpuMeter, Work, Worker};
use crate::error::{Error, Result};
use crate::wire::codec::{Codec, Contexts};
use crate::wire::frame::PageEncoding;
use crate::wire::page_frame::build_head;

/// One frame's buffers: its pages, their data as gathered, the header, the compressed data.
/// They travel to a packer and back, and are reused for later frames.
#[derive(Default)]
pub(crate) struct FrameBufs {
    pub pfns: Vec<(u64, PageEncoding)>,
    pub raw: Vec<u8>,
    pub head: Vec<u8>,
    pub packed: Vec<u8>,
}

/// A frame ready to write: `head`, then `data()`, then `trailer`.
pub(crate) struct Packed {
    pub bufs: FrameBufs,
    /// The codec tried, and the one the data went with (plain when it did not shrink).
    pub tried: Codec,
    pub used: Codec,
    pub trailer: [u8; 4],
    pub compress_time: Duration,
}

impl Packed {
    pub fn data(&self) -> &[u8] {
        if self.used == Codec::None {
            &self.bufs.raw
        } else {
            &self.bufs.packed
        }
    }
}

/// Compresses a gathered frame with `codec` (keeping it plain if that does not shrink it) and
/// builds its header and checksum trailer.
pub(crate) fn pack(mut bufs: FrameBufs, codec: Codec, ctx: &mut Contexts) -> Result<Packed> {
    ctx.prepare(codec)?;
    let started = Instant::now();
    let used = if codec == Codec::None {
        Codec::None
    } else {
        codec.compress(&bufs.raw, &mut bufs.packed, ctx)?;
        if bufs.packed.len() < bufs.raw.len() {
            codec
        } else {
            Codec::None
        }
    };
    let compress_time = started.elapsed();
    let data = if used == Codec::None {
        &bufs.raw
    } else {
        &bufs.packed
    };
    let data_len = data.len();
    build_head(&mut bufs.head, &bufs.pfns, used.flag_bits(), data_len);
    let mut crc = crc32fast::Hasher::new();
    crc.update(&bufs.head);
    crc.update(data);
    Ok(Packed {
        trailer: crc.finalize().to_le_bytes(),
        bufs,
        tried: codec,
        used,
        compress_time,
    })
}

struct Job {
    bufs: FrameBufs,
    codec: Codec,
    reply: SyncSender<Result<Packed>>,
}

/// A sender's packer threads and the frames they are working on, oldest first.
pub(crate) struct Packers {
    threads: usize,
    jobs: Option<Sender<Job>>,
    running: Vec<JoinHandle<()>>,
    waiting: VecDeque<Receiver<Result<Packed>>>,
    /// Where each packer counts its CPU time.
    cpu: CpuMeter,
}

impl Packers {
    /// `threads` packers (started at the first frame), each counting its CPU time in `cpu`.
    pub fn new(threads: usize, cpu: &CpuMeter) -> Self {
        Self {
            threads: threads.max(1),
            jobs: None,
            running: Vec::new(),
            waiting: VecDeque::new(),
            cpu: cpu.clone(),
        }
    }

    /// Whether as many frames are in the works as keep every packer busy: the oldest must be
    /// written before another is handed out (this bounds the memory held in frames).
    pub fn full(&self) -> bool {
        self.waiting.len() >= 2 * self.threads
    }

    /// Whether no frame is in the works.
    pub fn idle(&self) -> bool {
        self.waiting.is_empty()
    }

    /// Hands a gathered frame to a packer.
    pub fn submit(&mut self, bufs: FrameBufs, codec: Codec) -> Result<()> {
        let jobs = match &self.jobs {
            Some(j) => j,
            None => self.start()?,
        };
        let (reply, answer) = mpsc::sync_channel(1);
        jobs.send(Job { bufs, codec, reply })
            .map_err(|_| Error::State("the compressing threads are gone".into()))?;
        self.waiting.push_back(answer);
        Ok(())
    }

    /// The oldest frame in the works, once packed; `None` when there is none.
    pub fn next(&mut self) -> Option<Result<Packed>> {
        let answer = self.waiting.pop_front()?;
        Some(answer.recv().unwrap_or_else(|_| {
            Err(Error::State(
                "a compressing thread died with a frame".into(),
            ))
        }))
    }

    fn start(&mut self) -> Result<&Sender<Job>> {
        let (jobs, queue) = mpsc::channel::<Job>();
        let queue = Arc::new(Mutex::new(queue));
        for i in 0..self.threads {
            let queue = Arc::clone(&queue);
            let cpu = self.cpu.clone();
            let t = std::thread::Builder::new()
                .name(format!("ferry-pack-{i}"))
                .spawn(move || {
                    let _tracked = cpu.track(Work::Pack, Worker::Own);
                    let mut ctx = Contexts::default();
                    loop {
                        // One packer waits on the queue while the others wait for the lock.
                        let job = match queue.lock() {
                            Ok(q) => q.recv(),
                            Err(_) => return,
                        };
                        let Ok(Job { bufs, codec, reply }) = job else {
                            return; // the sender is done
                        };
                        let _ = reply.send(pack(bufs, codec, &mut ctx));
                    }
                })
                .map_err(|e| Error::vm_caused("cannot start a compressing thread", e))?;
            self.running.push(t);
        }
        Ok(self.jobs.insert(jobs))
    }
}

impl Drop for Packers {
    fn drop(&mut self) {
        // Closing the queue ends every packer once it has finished its frame.
        self.jobs = None;
        self.waiting.clear();
        for t in self.running.drain(..) {
            let _ = t.join();
        }
    }
}
