//! Writing at a conversation's home node (ARCHITECTURE §7): here, or
//! forwarded over the bus and answered from there. Above the bus and the
//! homes, so the cluster's modules depend one way.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::Either;
use imcore_actors::ConvId;

use super::bus::Bus;
use super::forward::{Forwarded, Route};
use crate::metrics::metrics;
use crate::store::{Heads, WriteOp, Written};
use crate::writer::{WriteFailure, Writer};

/// How long a forwarded write may take at its home before its caller is told
/// it may or may not have taken effect (a retry with the same key is safe).
/// Past the write path's own worst case (the lock timeout and a commit).
pub const FORWARD_WAIT: Duration = Duration::from_secs(10);

/// Writes `op` at `conv`'s home: queued on this node's `writer` when the home
/// is here (or there is no bus), else forwarded to the home node over the bus
/// and answered from there. Either way `op` is queued before this returns, so
/// one caller's writes keep their order (P6) as on one node.
///
/// A home that is not there (no node listens: it died or left before the
/// others noticed) or a bus that cannot take the request now: written here,
/// under the row lock like any write. An unanswered forward: `Internal` (it
/// may have been written; a retry with the same key is safe). A forwarded
/// write's seq goes to `heads` before its answer: its batch may not have
/// come over the bus yet, and a standby read must have it (ARCHITECTURE §6).
pub fn write_at_home(
    bus: Option<&Bus>,
    writer: &Writer,
    heads: &Arc<Heads>,
    conv: ConvId,
    op: WriteOp,
) -> impl Future<Output = Result<Written, WriteFailure>> + 'static {
    let Some(bus) = bus else { return Either::Left(writer.write(conv, op)) };
    let forwarded_to = conv.clone();
    let answer = match bus.forward(conv, op) {
        Route::Here(conv, op) => return Either::Left(writer.write(conv, op)),
        Route::Forwarded(answer) => answer,
    };
    let (writer, heads) = (writer.clone(), heads.clone());
    Either::Right(async move {
        let (outcome, result) = match tokio::time::timeout(FORWARD_WAIT, answer).await {
            Ok(Ok(Forwarded::Answered(result))) => {
                if let Some(seq) = result.as_ref().ok().and_then(Written::seq) {
                    heads.saw(&forwarded_to, seq);
                }
                ("answered", Some(result))
            }
            Ok(Ok(Forwarded::NotThere(conv, op))) => ("not_there", Some(writer.write(conv, op).await)),
            Ok(Ok(Forwarded::Lost)) | Ok(Err(_)) => ("lost", None),
            Err(_) => ("unanswered", None),
        };
        metrics().forwarded_writes.with_label_values(&[outcome]).inc();
        result
            .unwrap_or_else(|| Err(WriteFailure::internal("the write was forwarded to its home node and not answered")))
    })
}
