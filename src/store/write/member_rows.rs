//! The SQL of a batch's membership changes and conversation-row changes,
//! written in the order the ops made them. Runs of joins (and of leaves) are
//! one statement each, so an invite of 1,000 users is one INSERT.

use imcore_actors::ConvId;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Client;

use super::batch::{ConvPatch, MemberChange};
use crate::domain::ConvStatus;
use crate::store::StoreError;

const OPEN_PERIODS: &str = "
WITH opened AS (
  INSERT INTO membership_periods (conv_id, user_id, from_seq)
  SELECT $1, u, s FROM unnest($2::text[], $3::int8[]) AS j(u, s))
INSERT INTO members (conv_id, user_id, role, joined_seq)
SELECT $1, u, r, s FROM unnest($2::text[], $3::int8[], $4::text[]) AS j(u, s, r)";

const CLOSE_PERIODS: &str = "
WITH closed AS (
  UPDATE membership_periods p SET to_seq = l.s, closed_at = now(), left_view = l.v::jsonb
    FROM unnest($2::text[], $3::int8[], $4::text[]) AS l(u, s, v)
   WHERE p.conv_id = $1 AND p.user_id = l.u AND p.to_seq IS NULL)
DELETE FROM members WHERE conv_id = $1 AND user_id = ANY($2)";

const SET_STANDING: &str = "
UPDATE members SET role = $3, role_until = $4, extra_perms = $5, mute_until = $6
 WHERE conv_id = $1 AND user_id = $2";

const SET_ALIAS: &str = "UPDATE members SET alias = $3 WHERE conv_id = $1 AND user_id = $2";

/// Dismissal ends every open period at its seq; the roster rows stay (who
/// was a member when it was dismissed), applications go.
const CLOSE_ALL: &str = "
WITH closed AS (UPDATE membership_periods SET to_seq = $2, closed_at = now() WHERE conv_id = $1 AND to_seq IS NULL)
DELETE FROM group_applications WHERE conv_id = $1";

const APPLY: &str = "
INSERT INTO group_applications (conv_id, user_id, requested_by) VALUES ($1, $2, $3)
ON CONFLICT (conv_id, user_id) DO NOTHING";

const UNAPPLY: &str = "DELETE FROM group_applications WHERE conv_id = $1 AND user_id = $2";

pub(super) async fn write_member_changes(
    tx: &Client,
    conv: &ConvId,
    changes: &[MemberChange],
) -> Result<(), StoreError> {
    let c = conv.as_str();
    let mut rest = changes;
    while let Some(first) = rest.first() {
        let run = match first {
            MemberChange::Open { .. } => rest.iter().take_while(|c| matches!(c, MemberChange::Open { .. })).count(),
            MemberChange::Close { .. } => rest.iter().take_while(|c| matches!(c, MemberChange::Close { .. })).count(),
            _ => 1,
        };
        match first {
            MemberChange::Open { .. } | MemberChange::Close { .. } => periods(tx, c, &rest[..run]).await?,
            MemberChange::Standing { user, standing } => {
                let extra = standing.extra_perms as i32;
                tx.execute_typed(
                    SET_STANDING,
                    &[
                        (&c, Type::TEXT),
                        (&user.as_str(), Type::TEXT),
                        (&standing.role.as_str(), Type::TEXT),
                        (&standing.role_until, Type::TIMESTAMPTZ),
                        (&extra, Type::INT4),
                        (&standing.mute_until, Type::TIMESTAMPTZ),
                    ],
                )
                .await?;
            }
            MemberChange::Alias { user, alias } => {
                let params: [(&(dyn ToSql + Sync), Type); 3] =
                    [(&c, Type::TEXT), (&user.as_str(), Type::TEXT), (alias, Type::TEXT)];
                tx.execute_typed(SET_ALIAS, &params).await?;
            }
            MemberChange::CloseAll { seq } => {
                tx.execute_typed(CLOSE_ALL, &[(&c, Type::TEXT), (seq, Type::INT8)]).await?;
            }
            MemberChange::Apply { user, by } => {
                tx.execute_typed(APPLY, &[(&c, Type::TEXT), (&user.as_str(), Type::TEXT), (&by.as_str(), Type::TEXT)])
                    .await?;
            }
            MemberChange::Unapply { user } => {
                tx.execute_typed(UNAPPLY, &[(&c, Type::TEXT), (&user.as_str(), Type::TEXT)]).await?;
            }
        }
        rest = &rest[run..];
    }
    Ok(())
}

/// A run of opening (or of closing) periods, in one statement.
async fn periods(tx: &Client, conv: &str, run: &[MemberChange]) -> Result<(), StoreError> {
    let (mut users, mut seqs, mut roles, mut views) = (vec![], vec![], vec![], vec![]);
    for change in run {
        match change {
            MemberChange::Open { user, seq, role } => {
                users.push(user.as_str());
                seqs.push(*seq);
                roles.push(role.as_str());
            }
            MemberChange::Close { user, seq, view } => {
                users.push(user.as_str());
                seqs.push(*seq);
                views.push(view.as_str());
            }
            _ => {}
        }
    }
    if roles.is_empty() {
        let params = [
            (&conv as &(dyn ToSql + Sync), Type::TEXT),
            (&users, Type::TEXT_ARRAY),
            (&seqs, Type::INT8_ARRAY),
            (&views, Type::TEXT_ARRAY),
        ];
        tx.execute_typed(CLOSE_PERIODS, &params).await?;
    } else {
        tx.execute_typed(
            OPEN_PERIODS,
            &[(&conv, Type::TEXT), (&users, Type::TEXT_ARRAY), (&seqs, Type::INT8_ARRAY), (&roles, Type::TEXT_ARRAY)],
        )
        .await?;
    }
    Ok(())
}

/// Writes the batch's changes to the conversation row's settings, owner and status.
pub(super) async fn write_conv_patch(tx: &Client, conv: &ConvId, patch: &ConvPatch) -> Result<(), StoreError> {
    if patch.is_empty() {
        return Ok(());
    }
    let s = &patch.settings;
    let c = conv.as_str();
    let (name, owner) = (s.name.as_deref(), patch.owner.as_ref().map(|u| u.as_str()));
    let (join_mode, setting) = (s.join_mode.map(|m| m.as_str()), s.delivery_mode.map(|m| m.as_str()));
    let mode = patch.delivery_mode.map(|m| m.as_str());
    let (set_retention, retention) = (s.retention_ms.is_some(), s.retention_ms.flatten());
    // NULL keeps a column; `retention_ms` may be set to NULL (unlimited), hence its flag.
    tx.execute_typed(
        "UPDATE conversations SET name = coalesce($2, name), owner = coalesce($3, owner),
                join_mode = coalesce($4, join_mode), max_member = coalesce($5, max_member),
                mute_all = coalesce($6, mute_all), delivery_setting = coalesce($7, delivery_setting),
                recall_window_ms = coalesce($8, recall_window_ms),
                retention_ms = CASE WHEN $9 THEN $10 ELSE retention_ms END,
                status = coalesce($11, status),
                edit_window_ms = coalesce($12, edit_window_ms), delivery_mode = coalesce($13, delivery_mode)
          WHERE conv_id = $1",
        &[
            (&c, Type::TEXT),
            (&name, Type::TEXT),
            (&owner, Type::TEXT),
            (&join_mode, Type::TEXT),
            (&s.max_member, Type::INT4),
            (&s.mute_all, Type::BOOL),
            (&setting, Type::TEXT),
            (&s.recall_window_ms, Type::INT8),
            (&set_retention, Type::BOOL),
            (&retention, Type::INT8),
            (&patch.status.map(ConvStatus::as_str), Type::TEXT),
            (&s.edit_window_ms, Type::INT8),
            (&mode, Type::TEXT),
        ],
    )
    .await?;
    Ok(())
}
