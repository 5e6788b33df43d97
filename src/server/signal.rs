//! A signal a connection polls only after it has woken the connection's task, not each
//! time the connection is: the closing signal, whose every poll takes the shutdown
//! watch's lock, which every connection of every serving thread shares
//! (docs/BENCHMARKS.md: 3% of a refusal's CPU).

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Wake, Waker};

use futures_util::task::AtomicWaker;

/// A future (the connection's closing) polled only after it has woken the task.
pub(super) struct Signal<'a> {
    future: Pin<&'a mut (dyn Future<Output = ()> + Send + 'a)>,
    flag: Arc<WakeFlag>,
    waker: Waker,
    fired: bool,
    /// The task's waker as last registered: a task polled again with the same one (as
    /// a connection's task always is) is not registered again.
    task: Option<Waker>,
}

impl<'a> Signal<'a> {
    pub(super) fn new(future: Pin<&'a mut (dyn Future<Output = ()> + Send + 'a)>) -> Signal<'a> {
        let flag = Arc::new(WakeFlag {
            woken: AtomicBool::new(true),
            task: AtomicWaker::new(),
        });
        Signal {
            future,
            waker: Waker::from(Arc::clone(&flag)),
            flag,
            fired: false,
            task: None,
        }
    }

    /// Whether the signal has fired; until it has, the task of `cx` is woken when it may.
    pub(super) fn poll_fired(&mut self, cx: &mut Context<'_>) -> bool {
        if self.fired {
            return true;
        }
        if !self.task.as_ref().is_some_and(|t| t.will_wake(cx.waker())) {
            self.flag.task.register(cx.waker());
            self.task = Some(cx.waker().clone());
        }
        if self.flag.woken.swap(false, Ordering::AcqRel)
            && self
                .future
                .as_mut()
                .poll(&mut Context::from_waker(&self.waker))
                .is_ready()
        {
            self.fired = true;
        }
        self.fired
    }
}

/// The waker `drive` polls its closing signal with: it marks the signal woken and wakes
/// the connection's task.
struct WakeFlag {
    woken: AtomicBool,
    task: AtomicWaker,
}

impl Wake for WakeFlag {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.task.wake();
    }
}
