//! One plane served by a thread per core: listeners bound to one address with
//! `SO_REUSEPORT`, a single-threaded runtime on each thread, and the handles of those
//! runtimes for the runtime metrics. The accept loop, connections and their limits are
//! the parent's, shared with the single-listener [`super::serve`].

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::watch;

use super::{ConnectionSlots, Handler, Listener, ServeOptions, Transport, accept_loop};
use bloomgate_core::report::Chain;

/// The runtimes of a plane's serving threads, for the runtime metrics.
#[derive(Clone, Default)]
pub struct ServingRuntimes(Arc<std::sync::Mutex<Vec<tokio::runtime::Handle>>>);

impl ServingRuntimes {
    fn add(&self, handle: tokio::runtime::Handle) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(handle);
    }

    /// Serving runtimes, and the tasks alive on them (connections and what requests
    /// spawned).
    pub fn counts(&self) -> (usize, usize) {
        let handles = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let alive = handles.iter().map(|h| h.metrics().num_alive_tasks()).sum();
        (handles.len(), alive)
    }
}

/// Serves one plane on several listeners bound to one address with `SO_REUSEPORT`
/// (see [`bind_reuseport`]), each on a thread of its own that runs a single-threaded
/// runtime: the kernel spreads new connections over the listeners, and a connection
/// lives on the thread that accepted it, so a request is read, answered and written
/// without crossing threads. The bound on open connections is shared. Returns once every
/// thread has drained (see [`super::serve`]), with the connections left open in all of them.
///
/// Tasks a request spawns (a background refresh, HTTP/2 streams) run on its thread;
/// sockets it opens (a pooled database or upstream connection) are driven by that
/// thread's runtime, and may be used from others while it runs.
pub async fn serve_per_core<H: Handler>(
    listeners: Vec<std::net::TcpListener>,
    handler: Arc<H>,
    options: ServeOptions,
    transport: Transport,
    shutdown: watch::Receiver<bool>,
    name: &'static str,
) -> usize {
    let slots = ConnectionSlots::new(options.max_connections);
    let shared = Listener::new(handler, options, transport, name);
    let mut done = Vec::with_capacity(listeners.len());
    for (i, std_listener) in listeners.into_iter().enumerate() {
        let (tx, rx) = tokio::sync::oneshot::channel();
        // A listener of its own per thread: each request clones it (its `Arc` is the
        // request's hold on the handler), and one shared count would bounce its cache
        // line between the cores on every request.
        let shared = Arc::new(shared.clone());
        let (slots, shutdown) = (slots.clone(), shutdown.clone());
        let worker = move || {
            bloomgate_core::serving::enter(i);
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            let left = match runtime {
                Ok(rt) => rt.block_on(async move {
                    shared
                        .transport
                        .runtimes
                        .add(tokio::runtime::Handle::current());
                    match TcpListener::from_std(std_listener) {
                        Ok(listener) => {
                            let thread = i.to_string();
                            accept_loop(listener, shared, slots, shutdown, &thread).await
                        }
                        Err(e) => {
                            tracing::error!(listener = name, worker = i, error = %Chain(&e),
                                "cannot serve on this listener; the others go on");
                            0
                        }
                    }
                }),
                Err(e) => {
                    tracing::error!(listener = name, worker = i, error = %Chain(&e),
                        "cannot start a serving thread's runtime; the others go on");
                    0
                }
            };
            // The receiver is gone only if the caller stopped waiting.
            let _ = tx.send(left);
        };
        match std::thread::Builder::new()
            .name(format!("bloomgate-{name}-{i}"))
            .spawn(worker)
        {
            Ok(_) => done.push(rx),
            Err(e) => tracing::error!(listener = name, worker = i, error = %Chain(&e),
                "cannot start a serving thread; the others go on"),
        }
    }
    let mut left = 0;
    for rx in done {
        left += rx.await.unwrap_or(0);
    }
    left
}

/// `workers` listeners bound to `addr` with `SO_REUSEPORT` (and `SO_REUSEADDR`, as a
/// single listener has), for [`serve_per_core`]. With port 0 the first picks the port
/// and the others join it. Must run inside a tokio runtime; the listeners are returned
/// detached from it.
///
/// `SO_REUSEPORT` lets any process of the same user bind the same port too: the kernel
/// would then spread connections over both, so two instances started on one address by
/// mistake both come up instead of the second failing.
pub fn bind_reuseport(
    addr: SocketAddr,
    workers: usize,
) -> std::io::Result<Vec<std::net::TcpListener>> {
    let mut bound: Vec<std::net::TcpListener> = Vec::with_capacity(workers.max(1));
    let mut at = addr;
    for _ in 0..workers.max(1) {
        let socket = if at.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            tokio::net::TcpSocket::new_v6()?
        };
        socket.set_reuseaddr(true)?;
        socket.set_reuseport(true)?;
        socket.bind(at)?;
        let listener = socket.listen(LISTEN_BACKLOG)?.into_std()?;
        if bound.is_empty() {
            at = listener.local_addr()?;
        }
        bound.push(listener);
    }
    Ok(bound)
}

/// The accept queue of each listener (the kernel caps it at `net.core.somaxconn`).
const LISTEN_BACKLOG: u32 = 1024;
