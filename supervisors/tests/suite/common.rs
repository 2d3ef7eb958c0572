//! Helpers shared by the kernel tests: a recording worker and feed waits.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dsh_supervisors::tree::{RecvError, Subscription};
use dsh_supervisors::{Runtime, RuntimeSettings, TreeChange};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio::sync::Notify;

/// An append-only log the test actors and effects write into.
/// Also remembers the latest actor started under each recorder name.
#[derive(Clone, Default)]
pub struct Log(
    Arc<Mutex<Vec<String>>>,
    Arc<Mutex<HashMap<String, ActorRef<Msg>>>>,
);

impl Log {
    pub fn push(&self, s: impl Into<String>) {
        self.0.lock().unwrap().push(s.into());
    }
    pub fn lines(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
    /// The latest actor started as recorder `name`.
    pub fn actor(&self, name: &str) -> ActorRef<Msg> {
        self.1
            .lock()
            .unwrap()
            .get(name)
            .cloned()
            .expect("no such recorder")
    }
    pub fn count(&self, s: &str) -> usize {
        self.lines().iter().filter(|l| *l == s).count()
    }
}

pub enum Msg {
    Panic(&'static str),
    Hang(Arc<Notify>),
    Exit,
    Fail,
    Ping(RpcReplyPort<String>),
}

impl ractor::Message for Msg {}

/// A worker that logs `start <name>` and `stop <name>` (from `post_stop`).
pub struct Recorder {
    pub name: String,
    pub log: Log,
}

impl Recorder {
    pub fn new(name: impl Into<String>, log: &Log) -> Recorder {
        Recorder {
            name: name.into(),
            log: log.clone(),
        }
    }
}

impl Actor for Recorder {
    type Msg = Msg;
    type State = ();
    type Arguments = ();

    async fn pre_start(&self, me: ActorRef<Msg>, _args: ()) -> Result<(), ActorProcessingErr> {
        self.log.push(format!("start {}", self.name));
        self.log.1.lock().unwrap().insert(self.name.clone(), me);
        Ok(())
    }

    async fn handle(
        &self,
        me: ActorRef<Msg>,
        msg: Msg,
        _state: &mut (),
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            Msg::Panic(text) => panic!("{text}"),
            Msg::Hang(started) => {
                started.notify_one();
                futures::future::pending::<()>().await;
            }
            Msg::Exit => me.stop(None),
            Msg::Fail => return Err(format!("{} gave up", self.name).into()),
            Msg::Ping(reply) => {
                let _ = reply.send(self.name.clone());
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _me: ActorRef<Msg>,
        _state: &mut (),
    ) -> Result<(), ActorProcessingErr> {
        self.log.push(format!("stop {}", self.name));
        Ok(())
    }
}

pub async fn runtime() -> Runtime {
    Runtime::start(RuntimeSettings::default()).await.unwrap()
}

/// Waits (bounded) for the first feed change matching `pred`.
pub async fn wait_change(rx: &mut Subscription, pred: impl Fn(&TreeChange) -> bool) -> TreeChange {
    let found = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match rx.recv().await {
                Ok(c) if pred(&c) => return c,
                Ok(_) | Err(RecvError::Lagged(_)) => {}
                Err(RecvError::Closed) => panic!("tree feed closed"),
            }
        }
    })
    .await;
    found.expect("the expected tree change never came")
}

/// Bounds a step that must not hang (a deadlock fails the test instead).
pub async fn bounded<T>(what: &str, fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(20), fut)
        .await
        .unwrap_or_else(|_| panic!("{what} did not finish (deadlock?)"))
}
