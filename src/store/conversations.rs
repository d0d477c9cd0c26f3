//! Creating and reading conversations. Creation writes the conversation row and
//! the initial `join` events in one transaction (ARCHITECTURE §4): the creator
//! first, then the members in list order.

use chrono::{DateTime, Utc};
use imcore_actors::{ConvId, UserId};
use sha2::{Digest, Sha256};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{GenericClient, Row};

use super::error::decoded;
use super::write::{apply_ops, JoinOp, WriteOp};
use super::{Store, StoreError};
use crate::domain::{ConvStatus, DeliveryMode, DeliverySetting, Event, JoinMode, Rejection, Role};

#[derive(Debug, Clone)]
pub enum CreateConversation {
    /// Deterministic id per pair; creating again returns the existing one.
    Direct {
        creator: UserId,
        other: UserId,
    },
    Group {
        creator: UserId,
        conv_id: Option<ConvId>,
        name: String,
        members: Vec<UserId>,
        settings: GroupSettings,
    },
}

impl CreateConversation {
    /// The id the conversation will have, when it is known before it exists
    /// (a direct chat's, a group's chosen one); `None` for a generated id (and
    /// for a direct id that breaks its invariant: its creation fails anyway).
    pub fn known_id(&self) -> Option<ConvId> {
        match self {
            CreateConversation::Direct { creator, other } => direct_conv_id(creator, other).ok(),
            CreateConversation::Group { conv_id, .. } => conv_id.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct GroupSettings {
    pub delivery_mode: DeliverySetting,
    pub join_mode: JoinMode,
    pub max_member: i32,
    pub recall_window_ms: i64,
    pub retention_ms: Option<i64>,
    pub edit_window_ms: i64,
}

impl Default for GroupSettings {
    /// PROTOCOL §5 defaults.
    fn default() -> Self {
        Self {
            delivery_mode: DeliverySetting::Auto,
            join_mode: JoinMode::Invite,
            max_member: 500,
            recall_window_ms: 120_000,
            retention_ms: None,
            edit_window_ms: DEFAULT_EDIT_WINDOW_MS,
        }
    }
}

/// PROTOCOL v1.2: a message may be edited for a day after it was sent.
pub const DEFAULT_EDIT_WINDOW_MS: i64 = 86_400_000;

/// PROTOCOL §5 conversation object.
#[derive(Debug, Clone, PartialEq)]
pub struct ConversationInfo {
    pub conv_id: ConvId,
    pub kind: &'static str,
    pub name: Option<String>,
    pub owner: Option<String>,
    /// What it delivers in now.
    pub delivery_mode: DeliveryMode,
    /// What its admins chose (`auto` follows the member count).
    pub delivery_setting: DeliverySetting,
    pub join_mode: JoinMode,
    pub max_member: i32,
    pub member_count: i32,
    pub mute_all: bool,
    pub status: ConvStatus,
    pub head: i64,
    pub min_seq: i64,
    pub epoch: i32,
    pub recall_window_ms: i64,
    pub retention_ms: Option<i64>,
    pub created_at: DateTime<Utc>,
    pub edit_window_ms: i64,
}

#[derive(Debug)]
pub struct CreatedConversation {
    pub info: ConversationInfo,
    /// False when a direct conversation already existed.
    pub created: bool,
    /// The `join` events written, for delivery.
    pub events: Vec<Event>,
    /// Whether delivery sums up the joins of others (`Appended::members_summary`).
    pub members_summary: bool,
}

/// Prefix of direct conversation ids; refused for client-chosen group ids.
const DIRECT_PREFIX: &str = "d-";

/// The refusal of a client-chosen group id that is taken (`FORBIDDEN`), the
/// same whoever asks. That the id is not free cannot be hidden (a free one
/// would be created); `ALREADY_EXISTS` told a stranger that a group it cannot
/// see exists.
const TAKEN_ID: &str = "conv_id is not available: choose another, or omit it to have one assigned";

/// The id of the direct conversation of a pair, whoever creates it. Hex is in
/// the id alphabet, so the `Err` is a broken invariant, never an input's fault.
pub fn direct_conv_id(a: &UserId, b: &UserId) -> Result<ConvId, StoreError> {
    let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
    let digest = Sha256::digest(format!("{lo}\n{hi}").as_bytes());
    let id = format!("{DIRECT_PREFIX}{}", &hex::encode(digest)[..40]);
    ConvId::parse(&id).map_err(|_| StoreError::Invariant("a direct conv_id is not an id"))
}

pub(super) const CONVERSATION_COLUMNS: &str =
    "c.conv_id, c.kind, c.name, c.owner, c.delivery_mode, c.join_mode, c.max_member,
    c.member_count, c.mute_all, c.status, c.next_seq - 1, c.min_seq, c.epoch, c.recall_window_ms,
    c.retention_ms, c.created_at, c.edit_window_ms, c.delivery_setting";

/// Columns of [`CONVERSATION_COLUMNS`].
pub(super) const CONVERSATION_COLUMN_COUNT: usize = 18;

pub(super) fn conversation_from_row(r: &Row) -> Result<ConversationInfo, StoreError> {
    conversation_from_row_at(r, 0)
}

/// Decodes [`CONVERSATION_COLUMNS`] selected from column `at` on (a query that
/// selects other columns first, like the inbox's).
pub(super) fn conversation_from_row_at(r: &Row, at: usize) -> Result<ConversationInfo, StoreError> {
    Ok(ConversationInfo {
        conv_id: decoded(ConvId::parse(r.get(at)), "conv_id")?,
        kind: match r.get::<_, &str>(at + 1) {
            "group" => "group",
            "direct" => "direct",
            _ => return Err(StoreError::Undecodable("conversation kind")),
        },
        name: r.get(at + 2),
        owner: r.get(at + 3),
        delivery_mode: decoded(r.get::<_, &str>(at + 4).parse::<DeliveryMode>(), "delivery_mode")?,
        join_mode: decoded(r.get::<_, &str>(at + 5).parse::<JoinMode>(), "join_mode")?,
        max_member: r.get(at + 6),
        member_count: r.get(at + 7),
        mute_all: r.get(at + 8),
        status: decoded(r.get::<_, &str>(at + 9).parse::<ConvStatus>(), "status")?,
        head: r.get(at + 10),
        min_seq: r.get(at + 11),
        epoch: r.get(at + 12),
        recall_window_ms: r.get(at + 13),
        retention_ms: r.get(at + 14),
        created_at: r.get(at + 15),
        edit_window_ms: r.get(at + 16),
        delivery_setting: decoded(r.get::<_, &str>(at + 17).parse::<DeliverySetting>(), "delivery_setting")?,
    })
}

/// `$1` the creator and the members it names: their rows share-locked, so a
/// block by one of them (which locks its own row) is either committed and
/// seen by the read after this, or waits for the creation (blocks.rs).
const LOCK_NAMED_USERS: &str = "SELECT user_id FROM users WHERE user_id = ANY($1) ORDER BY user_id FOR SHARE";

/// `$1` the creator, `$2` the members it names: one who blocked the creator.
const BLOCKER_AMONG: &str = "SELECT 1 FROM blocks WHERE blocked = $1 AND blocker = ANY($2) LIMIT 1";

/// A new direct conversation of a creator `$2` who blocks the other member
/// `$3` starts with that member blocked (a block written before the
/// conversation existed flagged nothing).
const FLAG_BLOCKED_AT_CREATION: &str = "
UPDATE members SET blocked = true
 WHERE conv_id = $1 AND user_id = $3 AND EXISTS (SELECT 1 FROM blocks WHERE blocker = $2 AND blocked = $3)";

/// `NOT_FOUND` naming every one of `others` that is no user (so a client can
/// say which id failed); then `BLOCKED` when one of them blocked `creator`
/// (PROTOCOL v1.2): a direct conversation is not created (nor an existing one
/// answered), a group is not created with that member.
async fn refuse_unknown_and_blockers(
    tx: &impl GenericClient,
    creator: &UserId,
    others: &[UserId],
) -> Result<(), StoreError> {
    let mut named: Vec<&str> = others.iter().map(UserId::as_str).collect();
    let others_only = named.clone();
    named.push(creator.as_str());
    let found = tx.query_typed(LOCK_NAMED_USERS, &[(&named, Type::TEXT_ARRAY)]).await?;
    let found: std::collections::HashSet<&str> = found.iter().map(|r| r.get(0)).collect();
    let mut seen = std::collections::HashSet::new();
    let unknown: Vec<&str> = others_only.iter().copied().filter(|u| !found.contains(u) && seen.insert(*u)).collect();
    if !unknown.is_empty() {
        return Err(Rejection::unknown_users(&unknown).into());
    }
    let params: [(&(dyn ToSql + Sync), Type); 2] = [(&creator.as_str(), Type::TEXT), (&others_only, Type::TEXT_ARRAY)];
    if tx.query_typed_opt(BLOCKER_AMONG, &params).await?.is_some() {
        return Err(Rejection::Blocked.into());
    }
    Ok(())
}

impl Store {
    pub async fn create_conversation(&self, req: &CreateConversation) -> Result<CreatedConversation, StoreError> {
        let (conv_id, kind, creator, others, settings, name) = match req {
            CreateConversation::Direct { creator, other } => {
                if creator == other {
                    return Err(Rejection::BadRequest("a direct conversation needs another user".into()).into());
                }
                let id = direct_conv_id(creator, other)?;
                (id, "direct", creator, std::slice::from_ref(other), GroupSettings::default(), None)
            }
            CreateConversation::Group { creator, conv_id, name, members, settings } => {
                let id = match conv_id {
                    // Direct ids are derived from the pair; a group must never
                    // take one (it would capture that pair's direct chat).
                    Some(id) if id.as_str().starts_with(DIRECT_PREFIX) => {
                        return Err(Rejection::BadRequest(format!(
                            "conv_id may not start with `{DIRECT_PREFIX}`: reserved for direct conversations"
                        ))
                        .into())
                    }
                    Some(id) => id.clone(),
                    None => ConvId::parse(&format!("g-{}", uuid::Uuid::new_v4().simple()))
                        .map_err(|_| StoreError::Invariant("a generated conv_id is not an id"))?,
                };
                (id, "group", creator, members.as_slice(), settings.clone(), Some(name.as_str()))
            }
        };
        let owner = (kind == "group").then(|| creator.as_str());
        let mut conn = self.pool.get().await?;
        let (client, prepared) = conn.split().await?;
        let tx = client.transaction().await?;
        refuse_unknown_and_blockers(&tx, creator, others).await?;
        let inserted = tx
            .execute_typed(
                "INSERT INTO conversations (conv_id, kind, name, owner, delivery_mode, join_mode, max_member,
                                            recall_window_ms, retention_ms, edit_window_ms, delivery_setting)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) ON CONFLICT (conv_id) DO NOTHING",
                &[
                    (&conv_id.as_str(), Type::TEXT),
                    (&kind, Type::TEXT),
                    (&name, Type::TEXT),
                    (&owner, Type::TEXT),
                    (
                        &settings.delivery_mode.mode_at(DeliveryMode::Push, 0, self.large_groups.thresholds()).as_str(),
                        Type::TEXT,
                    ),
                    (&settings.join_mode.as_str(), Type::TEXT),
                    (&settings.max_member, Type::INT4),
                    (&settings.recall_window_ms, Type::INT8),
                    (&settings.retention_ms, Type::INT8),
                    (&settings.edit_window_ms, Type::INT8),
                    (&settings.delivery_mode.as_str(), Type::TEXT),
                ],
            )
            .await;
        let inserted = match inserted {
            Ok(n) => n,
            Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::FOREIGN_KEY_VIOLATION) => {
                return Err(Rejection::NotFound("user".into()).into())
            }
            Err(e) => return Err(e.into()),
        };
        if inserted == 0 {
            return match kind {
                "direct" => Ok(CreatedConversation {
                    info: read_conversation(&tx, &conv_id, creator).await?,
                    created: false,
                    events: vec![],
                    members_summary: false,
                }),
                // The same answer whoever holds the id and whatever it is:
                // only "not available", never whether the caller could see it.
                _ => Err(Rejection::Forbidden(TAKEN_ID.into()).into()),
            };
        }
        let mut joins = vec![WriteOp::Join(JoinOp {
            user: creator.clone(),
            actor: creator.clone(),
            role: if kind == "group" { Role::Owner } else { Role::Member },
        })];
        let mut seen = std::collections::HashSet::from([creator]);
        joins.extend(
            others
                .iter()
                .filter(|u| seen.insert(*u))
                .map(|u| WriteOp::Join(JoinOp { user: u.clone(), actor: creator.clone(), role: Role::Member })),
        );
        let written = apply_ops(&tx, prepared, &conv_id, joins, self.large_groups).await?;
        if let Some(Err(rejection)) = written.outcomes.into_iter().find(Result::is_err) {
            return Err(rejection.into()); // dropping `tx` rolls the whole creation back
        }
        if let ("direct", [other]) = (kind, others) {
            let params: [(&(dyn ToSql + Sync), Type); 3] =
                [(&conv_id.as_str(), Type::TEXT), (&creator.as_str(), Type::TEXT), (&other.as_str(), Type::TEXT)];
            tx.execute_typed(FLAG_BLOCKED_AT_CREATION, &params).await?;
        }
        // Read before COMMIT, on the same connection: nothing can fail after
        // the commit (a retry would create a second group).
        let info = read_conversation(&tx, &conv_id, creator).await?;
        tx.commit().await?;
        self.heads.saw(&conv_id, written.appended.head);
        let members_summary = written.appended.members_summary;
        Ok(CreatedConversation { info, created: true, events: written.appended.events, members_summary })
    }

    /// The conversation as `caller` may see it: anyone who has ever been a
    /// member (former members keep reading their history); else `NOT_MEMBER`,
    /// also for a conversation that does not exist.
    pub async fn get_conversation(&self, conv: &ConvId, caller: &UserId) -> Result<ConversationInfo, StoreError> {
        read_conversation(&**self.pool.get().await?, conv, caller).await
    }

    /// Admin: bump the epoch after the log was rebuilt (a restore). Clients
    /// holding the old epoch get `EPOCH_CHANGED` and resync from `min_seq`.
    pub async fn bump_epoch(&self, conv: &ConvId) -> Result<i32, StoreError> {
        let conn = self.pool.get().await?;
        let row = conn
            .query_prepared_opt(
                "UPDATE conversations SET epoch = epoch + 1 WHERE conv_id = $1 RETURNING epoch",
                &[(&conv.as_str(), Type::TEXT)],
            )
            .await?
            .ok_or(Rejection::NotFound("conversation".into()))?;
        self.tail.forget(conv);
        // Until its next commit, which a standby replays after the bump.
        self.heads.forget(conv);
        Ok(row.get(0))
    }
}

/// The conversation if `caller` was ever a member of it, else `NOT_MEMBER`
/// (also for one that does not exist: no existence leak). A former member
/// sees it as of its last `leave` (PROTOCOL §5): `head` at that seq, and the
/// settings and member count its `leave` recorded (`left_view`), so nothing
/// done after it shows.
async fn read_conversation(
    c: &impl GenericClient,
    conv: &ConvId,
    caller: &UserId,
) -> Result<ConversationInfo, StoreError> {
    let sql = format!(
        "SELECT {CONVERSATION_COLUMNS}, p.to_seq, p.left_view FROM conversations c
          CROSS JOIN LATERAL (SELECT to_seq, left_view FROM membership_periods p
                               WHERE p.conv_id = c.conv_id AND p.user_id = $2 ORDER BY from_seq DESC LIMIT 1) p
          WHERE c.conv_id = $1"
    );
    let row = c
        .query_typed_opt(&sql, &[(&conv.as_str(), Type::TEXT), (&caller.as_str(), Type::TEXT)])
        .await?
        .ok_or(Rejection::NotMember)?;
    let mut info = conversation_from_row(&row)?;
    if let Some(left_at) = row.get::<_, Option<i64>>(CONVERSATION_COLUMN_COUNT) {
        info.head = info.head.min(left_at);
    }
    let left = row
        .get::<_, Option<serde_json::Value>>(CONVERSATION_COLUMN_COUNT + 1)
        .map(serde_json::from_value::<LeftView>)
        .transpose()
        .map_err(|_| StoreError::Undecodable("membership_periods.left_view"))?;
    if let Some(v) = left {
        info.name = v.name;
        info.owner = v.owner;
        info.join_mode = decoded(v.join_mode.parse(), "left_view.join_mode")?;
        info.delivery_mode = decoded(v.delivery_mode.parse(), "left_view.delivery_mode")?;
        if let Some(s) = v.delivery_setting {
            info.delivery_setting = decoded(s.parse(), "left_view.delivery_setting")?;
        }
        (info.max_member, info.member_count, info.mute_all) = (v.max_member, v.member_count, v.mute_all);
        (info.recall_window_ms, info.retention_ms) = (v.recall_window_ms, v.retention_ms);
        info.edit_window_ms = v.edit_window_ms.unwrap_or(info.edit_window_ms);
        // Active when it left (a leave is a write, refused in any other
        // status): a dismissal or ban since is news from after.
        info.status = ConvStatus::Active;
    }
    Ok(info)
}

/// `membership_periods.left_view`, written by the batch of the `leave`.
#[derive(serde::Deserialize)]
struct LeftView {
    name: Option<String>,
    owner: Option<String>,
    join_mode: String,
    max_member: i32,
    member_count: i32,
    mute_all: bool,
    delivery_mode: String,
    /// Absent in views recorded before large groups switched by themselves.
    delivery_setting: Option<String>,
    recall_window_ms: i64,
    retention_ms: Option<i64>,
    /// Absent in views recorded before edits existed.
    edit_window_ms: Option<i64>,
}
