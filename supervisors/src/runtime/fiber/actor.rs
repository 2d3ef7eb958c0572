//! The actor behind every fiber: it runs loads, restarts and teardowns one
//! message at a time, and answers its children's exits (ractor supervision
//! events) with the fiber's policies.

use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};

use super::load::reevaluate;
use super::supervise::on_child_exit;
use super::teardown::{dispose, unload};
use super::{FiberMsg, FiberShared};
use crate::runtime::Runtime;
use crate::tree::Status;

/// The actor behind every fiber.
pub(crate) struct FiberActor;

pub(crate) struct FiberState {
    pub rt: Runtime,
    pub fiber: Arc<FiberShared>,
}

impl Actor for FiberActor {
    type Msg = FiberMsg;
    type State = FiberState;
    type Arguments = FiberState;

    async fn pre_start(
        &self,
        _myself: ActorRef<FiberMsg>,
        args: FiberState,
    ) -> std::result::Result<FiberState, ActorProcessingErr> {
        Ok(args)
    }

    async fn handle(
        &self,
        myself: ActorRef<FiberMsg>,
        msg: FiberMsg,
        state: &mut FiberState,
    ) -> std::result::Result<(), ActorProcessingErr> {
        let FiberState { rt, fiber } = state;
        fiber.node.stats.handled();
        match msg {
            // Boxed (here and below): a fiber waiting for messages does not carry
            // the state of a teardown or a load in its task.
            FiberMsg::Reevaluate => Box::pin(reevaluate(rt, fiber)).await,
            FiberMsg::Restart => {
                if fiber.status() == Status::Active || fiber.status() == Status::Failed {
                    Box::pin(unload(rt, fiber, Arc::from(Vec::new()))).await;
                    fiber.lock().loaded_with = None;
                    fiber.lock().error = None;
                    fiber.set_status(rt, Status::Pending);
                    Box::pin(reevaluate(rt, fiber)).await;
                }
            }
            FiberMsg::Dispose { chain, from_parent } => {
                let final_status = Box::pin(dispose(rt, fiber, chain, from_parent)).await;
                myself.stop(Some("disposed".to_owned()));
                fiber.phase.send_modify(|p| {
                    p.status = final_status;
                    p.stopped = true;
                });
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<FiberMsg>,
        evt: SupervisionEvent,
        state: &mut FiberState,
    ) -> std::result::Result<(), ActorProcessingErr> {
        let FiberState { rt, fiber } = state;
        let (cell, failure) = match evt {
            SupervisionEvent::ActorFailed(cell, err) => (cell, Some(err.to_string())),
            SupervisionEvent::ActorTerminated(cell, _, reason) => {
                let killed = reason.as_deref() == Some("killed");
                (cell, killed.then(|| "killed".to_owned()))
            }
            _ => return Ok(()),
        };
        if fiber.status() != Status::Active && fiber.status() != Status::Loading {
            return Ok(());
        }
        let pid = cell.get_id().pid();
        let Some(seq) = fiber.child_by_actor(pid) else {
            return Ok(());
        };
        let escalate = Box::pin(on_child_exit(rt, fiber, seq, failure)).await;
        if let Some(reason) = escalate {
            // Fail upward: tear everything down in order, then let ractor
            // report this actor's failure to our own supervisor.
            fiber.lock().error = Some(reason.clone());
            let mut order = Box::pin(unload(rt, fiber, Arc::from(Vec::new()))).await;
            order.push(fiber.id);
            fiber.lock().stop_order = Some(Arc::from(order));
            fiber.node.stats.set_status(Status::Failed);
            rt.tree().stopped(fiber.id, Status::Failed, &reason);
            fiber.phase.send_modify(|p| {
                p.status = Status::Failed;
                p.stopped = true;
            });
            if fiber.parent.is_none() {
                rt.root_failed(reason.clone());
                myself.stop(Some(reason));
                return Ok(());
            }
            return Err(reason.into());
        }
        Ok(())
    }
}
