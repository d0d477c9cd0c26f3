//! The rules of an `events` and a `conversations` row (ARCHITECTURE §2):
//! migration 0016 replaced each table's CHECKs with one calling a PL/pgSQL
//! function (`event_rules_hold` simplifies the rules for a `msg` row). Over a
//! corpus of rows each table's CHECK must refuse exactly the rows the old CHECKs
//! refused, and the corpus must tell each rule apart: without any one of
//! them, the others accept a row the function refuses.

use serde_json::json;

use crate::evidence::record;
use crate::harness::TestDb;

/// The seventeen CHECKs of `events` as migrations 0001-0015 left them
/// (`pg_get_constraintdef`), by constraint name.
const EVENT_RULES: [(&str, &str); 17] = [
    (
        "events_check",
        "kind <> 'msg' OR (message_id IS NOT NULL AND sender_user IS NOT NULL AND sender_device IS NOT NULL \
         AND client_msg_id IS NOT NULL AND request_hash IS NOT NULL AND (recalled OR body IS NOT NULL))",
    ),
    ("events_check2", "kind <> ALL (ARRAY['join', 'leave']) OR (subject_user IS NOT NULL AND actor IS NOT NULL)"),
    ("events_check3", "(kind = 'leave') = (reason IS NOT NULL)"),
    ("events_check4", "kind <> 'recall' OR (sender_user IS NOT NULL AND target_seq IS NOT NULL AND target_seq < seq)"),
    (
        "events_client_msg_id_check",
        "length(client_msg_id) >= 1 AND length(client_msg_id) <= 64 AND client_msg_id ~ '^[A-Za-z0-9._:@-]+$'",
    ),
    (
        "events_edit",
        "kind <> 'edit' OR (sender_user IS NOT NULL AND sender_device IS NOT NULL AND client_msg_id IS NOT NULL \
         AND request_hash IS NOT NULL AND target_seq IS NOT NULL AND target_seq < seq)",
    ),
    ("events_emoji_check", "octet_length(emoji) >= 1 AND octet_length(emoji) <= 32"),
    (
        "events_group",
        "kind <> 'group' OR (change IS NOT NULL \
         AND (actor IS NOT NULL OR change = ANY (ARRAY['{\"status\":\"banned\"}', '{\"status\":\"active\"}'])))",
    ),
    ("events_kind_check", "kind = ANY (ARRAY['msg', 'recall', 'join', 'leave', 'group', 'edit', 'reaction'])"),
    (
        "events_msg_fields",
        "kind = 'msg' OR (reply_to IS NULL AND mentions IS NULL AND mention_all IS NULL AND edited_at IS NULL)",
    ),
    (
        "events_reaction",
        "((kind = 'reaction') = (emoji IS NOT NULL AND reaction_on IS NOT NULL)) \
         AND (kind <> 'reaction' OR (sender_user IS NOT NULL AND target_seq IS NOT NULL AND target_seq < seq))",
    ),
    ("events_reason_check", "reason = ANY (ARRAY['left', 'kicked', 'dismissed'])"),
    ("events_recalled_msg", "kind = 'msg' OR NOT recalled"),
    ("events_reply_before", "reply_to IS NULL OR reply_to < seq"),
    ("events_request_hash_check", "length(request_hash) = 32"),
    ("events_request_key_kinds", "kind = ANY (ARRAY['msg', 'edit']) OR client_msg_id IS NULL"),
    ("events_seq_check", "seq >= 1"),
];

/// A `msg` row that holds every rule, as `jsonb` (also the id-rule test's).
pub const EVENT_MSG: &str = r#"{"kind":"msg","seq":5,"message_id":"00000000-0000-0000-0000-000000000001",
  "sender_user":"u","sender_device":"d","client_msg_id":"k1",
  "request_hash":"\\x0000000000000000000000000000000000000000000000000000000000000000","body":"b","recalled":false,
  "reply_to":2,"mentions":["a"],"mention_all":true,"edited_at":"2026-01-01T00:00:00Z"}"#;

/// An `edit` row that holds every rule.
pub const EVENT_EDIT: &str = r#"{"kind":"edit","seq":5,"sender_user":"u","sender_device":"d","client_msg_id":"k2",
  "request_hash":"\\x0000000000000000000000000000000000000000000000000000000000000000","body":"b","target_seq":3,
  "recalled":false}"#;

/// A row of each kind that holds every rule.
const EVENT_ROWS: [&str; 7] = [
    EVENT_MSG,
    r#"{"kind":"recall","seq":5,"sender_user":"u","target_seq":3,"recalled":false}"#,
    r#"{"kind":"join","seq":5,"subject_user":"u","actor":"a","recalled":false}"#,
    r#"{"kind":"leave","seq":5,"subject_user":"u","actor":"a","reason":"left","recalled":false}"#,
    r#"{"kind":"group","seq":5,"actor":"a","change":"{\"name\":\"x\"}","recalled":false}"#,
    EVENT_EDIT,
    r#"{"kind":"reaction","seq":5,"sender_user":"u","target_seq":3,"emoji":"+1","reaction_on":true,"recalled":false}"#,
];

/// Values each column is set to in the corpus: null, the rules' edges and
/// values no rule allows.
const EVENT_VALUES: &str = r#"
('kind','"msg"'),('kind','"recall"'),('kind','"join"'),('kind','"leave"'),('kind','"group"'),('kind','"edit"'),
('kind','"reaction"'),('kind','"other"'),
('seq','0'),('seq','1'),('seq','3'),
('message_id','null'),('sender_user','null'),('sender_device','null'),('sender_device','"d"'),
('client_msg_id','null'),('client_msg_id','""'),('client_msg_id','"bad id"'),
('client_msg_id','"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"'),('client_msg_id','"k3"'),
('request_hash','null'),('request_hash','"\\x00"'),
('request_hash','"\\x0000000000000000000000000000000000000000000000000000000000000000"'),
('body','null'),('body','"b"'),('subject_user','null'),('subject_user','"s"'),('actor','null'),('actor','"a"'),
('reason','null'),('reason','"left"'),('reason','"kicked"'),('reason','"dismissed"'),('reason','"other"'),
('target_seq','null'),('target_seq','5'),('target_seq','9'),('target_seq','1'),
('change','null'),('change','"{\"status\":\"banned\"}"'),('change','"{\"status\":\"active\"}"'),
('change','"{\"name\":\"y\"}"'),
('recalled','true'),('recalled','false'),('reply_to','null'),('reply_to','5'),('reply_to','1'),
('mentions','null'),('mentions','["b"]'),('mention_all','null'),('mention_all','false'),
('edited_at','null'),('edited_at','"2026-01-02T00:00:00Z"'),
('emoji','null'),('emoji','""'),('emoji','"+1"'),('emoji','"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"'),
('reaction_on','null'),('reaction_on','false')"#;

/// The eighteen CHECKs of `conversations` as migrations 0001-0015 left them.
const CONVERSATION_RULES: [(&str, &str); 18] = [
    ("conversations_check", "min_seq <= next_seq"),
    ("conversations_check1", "kind = 'group' OR (owner IS NULL AND name IS NULL)"),
    (
        "conversations_conv_id_check",
        "length(conv_id) >= 1 AND length(conv_id) <= 64 AND conv_id ~ '^[A-Za-z0-9._:@-]+$'",
    ),
    ("conversations_delivery_mode_check", "delivery_mode = ANY (ARRAY['push', 'pull'])"),
    ("conversations_delivery_setting_check", "delivery_setting = ANY (ARRAY['auto', 'push', 'pull'])"),
    ("conversations_edit_window_ms_check", "edit_window_ms >= 0"),
    ("conversations_epoch_check", "epoch >= 1"),
    ("conversations_join_mode_check", "join_mode = ANY (ARRAY['invite', 'approval', 'free'])"),
    ("conversations_kind_check", "kind = ANY (ARRAY['direct', 'group'])"),
    ("conversations_max_member_check", "max_member >= 1 AND max_member <= 1000000"),
    ("conversations_member_count_check", "member_count >= 0"),
    ("conversations_member_version_check", "member_version >= 0"),
    ("conversations_min_seq_check", "min_seq >= 1"),
    ("conversations_name_check", "length(name) <= 128"),
    ("conversations_next_seq_check", "next_seq >= 1"),
    ("conversations_recall_window_ms_check", "recall_window_ms >= 0"),
    ("conversations_retention_ms_check", "retention_ms IS NULL OR retention_ms > 0"),
    ("conversations_status_check", "status = ANY (ARRAY['active', 'dismissed', 'banned'])"),
];

/// A group that holds every rule, as `jsonb` (also the id-rule test's).
pub const CONVERSATION_GROUP: &str = r#"{"conv_id":"g-1","kind":"group","delivery_mode":"pull",
  "delivery_setting":"pull","name":"n","owner":"u","join_mode":"free","max_member":1000000,"status":"banned",
  "recall_window_ms":5,"edit_window_ms":5,"retention_ms":1,"epoch":3,"min_seq":4,"next_seq":9,"member_version":7,
  "member_count":3}"#;

/// A direct and a group conversation that hold every rule.
const CONVERSATION_ROWS: [&str; 2] = [
    r#"{"conv_id":"d:a:b","kind":"direct","delivery_mode":"push","delivery_setting":"auto","join_mode":"invite",
  "max_member":2,"status":"active","recall_window_ms":0,"edit_window_ms":0,"epoch":1,"min_seq":1,"next_seq":1,
  "member_version":0,"member_count":0}"#,
    CONVERSATION_GROUP,
];

/// Values each column of `conversations` is set to in the corpus; `min_seq`
/// null too (a NOT NULL column), so that `next_seq >= 1`, which the other
/// rules imply for a non-null `min_seq`, is told apart as well.
const CONVERSATION_VALUES: &str = r#"
('conv_id','""'),('conv_id','"bad id"'),('conv_id','"g-2"'),
('conv_id','"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"'),
('kind','"direct"'),('kind','"group"'),('kind','"other"'),
('delivery_mode','"push"'),('delivery_mode','"pull"'),('delivery_mode','"auto"'),
('delivery_setting','"auto"'),('delivery_setting','"other"'),
('name','null'),('name','""'),('name','"nnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnn"'),
('owner','null'),('owner','"v"'),
('join_mode','"approval"'),('join_mode','"other"'),
('max_member','0'),('max_member','1'),('max_member','1000001'),
('status','"active"'),('status','"dismissed"'),('status','"other"'),
('recall_window_ms','-1'),('edit_window_ms','-1'),('retention_ms','null'),('retention_ms','0'),('retention_ms','-5'),
('epoch','0'),('min_seq','null'),('min_seq','0'),('min_seq','9'),('min_seq','10'),('next_seq','0'),('next_seq','3'),
('member_version','-1'),('member_count','-1')"#;

/// A table's old rules and a corpus: each valid row, and each with one or
/// two columns set to one of the values. The table's CHECK `{table}_rules`
/// is read from the catalog.
struct RuleSet {
    table: &'static str,
    rules: &'static [(&'static str, &'static str)],
    rows: &'static [&'static str],
    values: &'static str,
}

/// Evaluates the corpus; records and asserts that the table's CHECK refuses
/// exactly what the rules refuse, and that no rule is redundant on it.
async fn holds_the_old_rules(set: RuleSet, id: &str) {
    let db = TestDb::with_pool(1).await;
    let client = db.client().await;
    let check: String = client
        .query_one(
            "SELECT pg_get_expr(conbin, conrelid) FROM pg_constraint WHERE conname = $1",
            &[&format!("{}_rules", set.table)],
        )
        .await
        .expect("the table's CHECK")
        .get(0);
    // A CHECK passes unless its rule is false.
    let holds = |rule: &str| format!("coalesce(({rule}), true)");
    let all_but = |skip: Option<usize>| {
        let rules: Vec<String> =
            set.rules.iter().enumerate().filter(|(i, _)| Some(*i) != skip).map(|(_, (_, r))| holds(r)).collect();
        rules.join(" AND ")
    };
    let function = holds(&check);
    let mut columns = vec![
        format!("count(*) FILTER (WHERE ({function}) IS DISTINCT FROM ({}))", all_but(None)),
        format!("count(*) FILTER (WHERE {})", all_but(None)),
        "count(*)".to_owned(),
    ];
    columns.extend(
        (0..set.rules.len()).map(|i| format!("count(*) FILTER (WHERE {} AND NOT {function})", all_but(Some(i)))),
    );
    let sql = format!(
        "WITH valid(t) AS (SELECT t::jsonb FROM unnest($1::text[]) v(t)),
              vals(col, v) AS (VALUES {}),
              corpus(t) AS (
                SELECT t FROM valid
                UNION ALL SELECT t || jsonb_build_object(a.col, a.v::jsonb) FROM valid, vals a
                UNION ALL SELECT t || jsonb_build_object(a.col, a.v::jsonb, b.col, b.v::jsonb)
                            FROM valid, vals a, vals b WHERE a.col < b.col)
         SELECT {} FROM corpus, jsonb_populate_record(NULL::{}, t) e",
        set.values,
        columns.join(", "),
        set.table
    );
    let row = client.query_one(&sql, &[&set.rows]).await.expect("evaluate the corpus");
    let counts: Vec<i64> = (0..columns.len()).map(|i| row.get(i)).collect();
    let (disagree, accepted, rows) = (counts[0], counts[1], counts[2]);
    let told_apart: serde_json::Map<String, serde_json::Value> =
        set.rules.iter().zip(&counts[3..]).map(|((name, _), n)| ((*name).to_owned(), json!(n))).collect();
    let pass = disagree == 0 && accepted > 0 && accepted < rows && counts[3..].iter().all(|n| *n > 0);
    record(
        "im-04",
        id,
        "sql",
        &format!(
            "over a corpus of {} rows (each valid row with one or two columns set to null, edge or forbidden values), \
             its one CHECK refuses exactly the rows the {} CHECKs of 0001-0015 refused; negative controls: \
             without any one of them, the others accept a row the one CHECK refuses",
            set.table,
            set.rules.len()
        ),
        json!({"check": check, "rows": rows, "accepted": accepted, "disagreements": disagree, "refused_only_by_the_rule": told_apart}),
        pass,
    );
    assert!(pass);
}

#[actix_web::test]
async fn the_events_rules_function_refuses_exactly_what_the_seventeen_checks_refused() {
    let set = RuleSet { table: "events", rules: &EVENT_RULES, rows: &EVENT_ROWS, values: EVENT_VALUES };
    holds_the_old_rules(set, "04-events-rules-function-is-the-seventeen-rules").await;
}

#[actix_web::test]
async fn the_conversations_rules_function_refuses_exactly_what_the_eighteen_checks_refused() {
    let set = RuleSet {
        table: "conversations",
        rules: &CONVERSATION_RULES,
        rows: &CONVERSATION_ROWS,
        values: CONVERSATION_VALUES,
    };
    holds_the_old_rules(set, "04-conversations-rules-function-is-the-eighteen-rules").await;
}
