//! The notifier's loop, on its own thread: takes committed batches in, finds
//! who is due (paged, from the push targets), offers notices to the queue,
//! starts the requests whose time came and settles their answers; flushes
//! progress and looks for lag to recover on timers (`progress`).

use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use chrono::Utc;
use imcore_actors::ConvId;
use tokio::sync::mpsc;

use super::due::{level_of, notice};
use super::gateway::{body, Answer, Gateways};
use super::queue::{Offer, Outcome, Outgoing, Queue, Settled, Target};
use super::Lost;
use crate::config::NotifySettings;
use crate::delivery::Delivery;
use crate::domain::{Event, EventKind};
use crate::metrics::{count_notifications, metrics};
use crate::store::{Appended, Report, Store, StoreError};

/// Push targets read per page of "who is due".
const PAGE_USERS: i64 = 500;

/// A request's end, back from its task.
type Done = (Outgoing, Answer, Duration);

pub(super) struct Runner {
    pub(super) store: Store,
    delivery: Weak<Delivery>,
    pub(super) settings: NotifySettings,
    /// This process's name on progress leases: random per start.
    pub(super) node: String,
    pub(super) queue: Queue,
    gateways: Rc<Gateways>,
    /// Conversations with push targets taken in since their progress was last written.
    pub(super) dirty: HashSet<ConvId>,
    pub(super) lost: Lost,
    done_tx: mpsc::UnboundedSender<Done>,
}

impl Runner {
    pub(super) fn new(
        store: Store,
        delivery: Weak<Delivery>,
        settings: NotifySettings,
        lost: Lost,
    ) -> (Self, mpsc::UnboundedReceiver<Done>) {
        let (done_tx, done_rx) = mpsc::unbounded_channel();
        let per_url_pending = (settings.max_pending / 4).max(1);
        let runner = Self {
            queue: Queue::new(settings.max_pending, per_url_pending, settings.coalesce()),
            gateways: Gateways::new(settings.per_url, settings.timeout()),
            node: format!("notify-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]),
            dirty: HashSet::new(),
            store,
            delivery,
            settings,
            lost,
            done_tx,
        };
        (runner, done_rx)
    }

    /// Until the server's delivery (every sender of `batches`) is gone.
    pub(super) async fn run(
        mut self,
        mut done_rx: mpsc::UnboundedReceiver<Done>,
        mut batches: mpsc::Receiver<Arc<Appended>>,
    ) {
        let mut flush = tokio::time::interval(self.settings.flush());
        let mut scan = tokio::time::interval(self.settings.lease() / 2);
        for t in [&mut flush, &mut scan] {
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        }
        loop {
            let wake = self.queue.next_due().unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
            tokio::select! {
                Some((sent, answer, took)) = done_rx.recv() => self.finished(sent, answer, took).await,
                batch = batches.recv() => match batch {
                    Some(b) => self.take(&b.conv_id, &b.events).await,
                    None => break,
                },
                () = tokio::time::sleep_until(wake.into()) => {}
                _ = flush.tick() => {
                    self.reread_lost().await;
                    self.flush().await;
                }
                _ = scan.tick() => self.recover().await,
            }
            self.start_due();
            metrics().notify_queue.set(i64::try_from(self.queue.depth()).unwrap_or(i64::MAX));
        }
    }

    /// Takes `events` (one batch of `conv`, ascending) in; a failure to read
    /// who is due leaves them to be read back (`Lost`).
    pub(super) async fn take(&mut self, conv: &ConvId, events: &[Event]) {
        let (Some(first), Some(last)) = (events.first(), events.last()) else { return };
        self.queue.taking(conv, first.seq, last.seq);
        if let Err(e) = self.resolve(conv, events).await {
            tracing::warn!(error = %Report(&e), %conv, "notifier: who is due not read; read back later");
            let mut lost = self.lost.lock().unwrap_or_else(|e| e.into_inner());
            let at = lost.entry(conv.clone()).or_insert(first.seq);
            *at = (*at).min(first.seq);
        }
        self.queue.taken(conv, first.seq);
    }

    async fn resolve(&mut self, conv: &ConvId, events: &[Event]) -> Result<(), StoreError> {
        let subjects = |leave: bool| -> Vec<&str> {
            events
                .iter()
                .filter_map(|e| match &e.kind {
                    EventKind::Join { subject, .. } if !leave => Some(subject.as_str()),
                    EventKind::Leave { subject, .. } if leave => Some(subject.as_str()),
                    _ => None,
                })
                .collect()
        };
        let joined = subjects(false);
        if !joined.is_empty() {
            self.store.add_push_targets(conv, &joined).await?;
        }
        let Some(delivery) = self.delivery.upgrade() else { return Ok(()) };
        let (lo, hi) = (events.first().map_or(0, |e| e.seq), events.last().map_or(0, |e| e.seq));
        let now = Instant::now();
        let mut after = String::new();
        // Read once a page has someone due: most batches have no one, and cost one query.
        let mut known = None;
        loop {
            let (rows, next) = self.store.due_page(conv, (lo, hi), &after, PAGE_USERS).await?;
            if known.is_none() && !rows.is_empty() {
                let senders: Vec<&str> = events.iter().filter_map(|e| sender_of(&e.kind)).collect();
                let (Some(facts), names) = self.store.conv_facts(conv, &senders).await? else { return Ok(()) };
                known = Some((facts, names));
            }
            for row in rows {
                let Some((facts, names)) = &known else { break };
                if delivery.device_connected(&row.user, &row.device) {
                    continue;
                }
                let level = level_of(&row, facts, self.settings.all_max_members);
                let target = Target {
                    user: row.user.clone(),
                    device: row.device.clone(),
                    app_id: row.app_id.clone(),
                    pushkey: row.pushkey.clone(),
                    url: row.url.clone(),
                    data: row.data.clone(),
                    pushkey_ts: row.pushkey_at.timestamp(),
                };
                for event in events {
                    let Some(mut n) = notice(event, &row, level, facts.direct) else { continue };
                    let age = (Utc::now() - event.created_at).to_std().unwrap_or_default();
                    let Some(left) = self.settings.give_up().checked_sub(age) else {
                        count_notifications("given_up", 1);
                        continue;
                    };
                    n.room_name = facts.name.clone();
                    n.sender_name = names.get(n.sender.as_str()).cloned();
                    match self.queue.offer(conv, target.clone(), n, now + left, now) {
                        Offer::Queued => {}
                        Offer::Coalesced => count_notifications("coalesced", 1),
                        Offer::Dropped => count_notifications("dropped", 1),
                    }
                }
            }
            match next {
                Some(user) => after = user,
                None => break,
            }
        }
        let left = subjects(true);
        if !left.is_empty() {
            self.store.drop_push_targets(conv, &left).await?;
        }
        if known.is_some() {
            self.dirty.insert(conv.clone());
        }
        Ok(())
    }

    /// Starts a task per notification whose time came.
    fn start_due(&mut self) {
        for out in self.queue.due(Instant::now()) {
            let (store, gateways, tx) = (self.store.clone(), self.gateways.clone(), self.done_tx.clone());
            actix_web::rt::spawn(async move {
                let started = Instant::now();
                let answer = match store.unread_total(&out.target.user).await {
                    Ok(unread) => {
                        gateways.post(&out.target, &body(out.key.0.as_str(), &out.notice, &out.target, unread)).await
                    }
                    Err(e) => {
                        tracing::warn!(error = %Report(&e), "notifier: unread count not read; retried");
                        Answer { outcome: Outcome::Retry, rejected: false }
                    }
                };
                let _ = tx.send((out, answer, started.elapsed()));
            });
        }
    }

    async fn finished(&mut self, sent: Outgoing, answer: Answer, took: Duration) {
        metrics().notify_gateway.observe(took.as_secs_f64());
        if answer.rejected {
            count_notifications("rejected", 1);
            let t = &sent.target;
            if let Err(e) = self.store.remove_pusher(&t.user, &t.app_id, &t.pushkey).await {
                tracing::warn!(error = %Report(&e), "notifier: a rejected pusher not removed");
            }
            self.queue.forget(&t.app_id, &t.pushkey);
        }
        let backoff = self.settings.backoff(Queue::attempts(&sent) + 1);
        match (self.queue.finished(sent, answer.outcome, backoff, Instant::now()), answer) {
            (Settled::Retrying, _) => count_notifications("retried", 1),
            (Settled::GivenUp, _) => count_notifications("given_up", 1),
            (Settled::Done, Answer { outcome: Outcome::Delivered, .. }) => count_notifications("sent", 1),
            (Settled::Done, Answer { rejected: false, .. }) => count_notifications("failed", 1),
            (Settled::Done, _) => {}
        }
    }
}

/// Who an event is from, for the display names a notification carries.
fn sender_of(kind: &EventKind) -> Option<&str> {
    match kind {
        EventKind::Msg { sender, .. } => Some(sender.as_str()),
        EventKind::Join { actor, .. } | EventKind::Leave { actor, .. } => Some(actor.as_str()),
        EventKind::Group { actor, .. } => actor.as_ref().map(|a| a.as_str()),
        EventKind::Edit { .. } | EventKind::Reaction { .. } | EventKind::Recall { .. } => None,
    }
}

/// Per conversation, the first seq to read back (the `Lost` map, taken).
pub(super) fn take_lost(lost: &Lost) -> HashMap<ConvId, i64> {
    std::mem::take(&mut *lost.lock().unwrap_or_else(|e| e.into_inner()))
}
