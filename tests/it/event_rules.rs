//! The rules of an `events` row (ARCHITECTURE §2): migration 0016 replaced
//! the table's seventeen CHECKs with one calling `event_rules_hold`, which
//! simplifies them for a `msg` row. Over a corpus of rows the function must
//! refuse exactly the rows the seventeen refused, and the corpus must tell
//! each rule apart: without any one of them, the others accept a row the
//! function refuses.

use serde_json::json;

use crate::evidence::record;
use crate::harness::TestDb;

/// The seventeen CHECKs of `events` as migrations 0001-0015 left them
/// (`pg_get_constraintdef`), by constraint name.
const SEVENTEEN: [(&str, &str); 17] = [
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

/// A row each kind may hold (every rule holds), as `jsonb`.
const TEMPLATES: &str = r#"
('{"kind":"msg","seq":5,"message_id":"00000000-0000-0000-0000-000000000001","sender_user":"u","sender_device":"d",
   "client_msg_id":"k1","request_hash":"\\x0000000000000000000000000000000000000000000000000000000000000000",
   "body":"b","recalled":false,"reply_to":2,"mentions":["a"],"mention_all":true,"edited_at":"2026-01-01T00:00:00Z"}'),
('{"kind":"recall","seq":5,"sender_user":"u","target_seq":3,"recalled":false}'),
('{"kind":"join","seq":5,"subject_user":"u","actor":"a","recalled":false}'),
('{"kind":"leave","seq":5,"subject_user":"u","actor":"a","reason":"left","recalled":false}'),
('{"kind":"group","seq":5,"actor":"a","change":"{\"name\":\"x\"}","recalled":false}'),
('{"kind":"edit","seq":5,"sender_user":"u","sender_device":"d","client_msg_id":"k2",
   "request_hash":"\\x0000000000000000000000000000000000000000000000000000000000000000","body":"b","target_seq":3,
   "recalled":false}'),
('{"kind":"reaction","seq":5,"sender_user":"u","target_seq":3,"emoji":"+1","reaction_on":true,"recalled":false}')"#;

/// Values each column is set to in the corpus (a template with one or two of
/// them changed): null, the rules' edges and values no rule allows.
const VALUES: &str = r#"
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

/// The CHECK's call, on the corpus row `e`.
const CALL: &str = "event_rules_hold(e.kind, e.seq, e.message_id, e.sender_user, e.sender_device, e.client_msg_id, \
     e.request_hash, e.body, e.subject_user, e.actor, e.reason, e.target_seq, e.change, e.recalled, e.reply_to, \
     e.mentions, e.mention_all, e.edited_at, e.emoji, e.reaction_on)";

#[actix_web::test]
async fn the_events_rules_function_refuses_exactly_what_the_seventeen_checks_refused() {
    let db = TestDb::with_pool(1).await;
    let client = db.client().await;
    // A CHECK passes unless its rule is false.
    let holds = |rule: &str| format!("coalesce(({rule}), true)");
    let all_but = |skip: Option<usize>| {
        let rules: Vec<String> =
            SEVENTEEN.iter().enumerate().filter(|(i, _)| Some(*i) != skip).map(|(_, (_, r))| holds(r)).collect();
        rules.join(" AND ")
    };
    let mut columns = vec![
        format!("count(*) FILTER (WHERE ({}) IS DISTINCT FROM ({}))", holds(CALL), all_but(None)),
        format!("count(*) FILTER (WHERE {})", all_but(None)),
        "count(*)".to_owned(),
        "count(*) FILTER (WHERE e.kind = 'msg')".to_owned(),
    ];
    columns.extend(
        (0..SEVENTEEN.len()).map(|i| format!("count(*) FILTER (WHERE {} AND NOT {})", all_but(Some(i)), holds(CALL))),
    );
    let sql = format!(
        "WITH templates(t) AS (SELECT t::jsonb FROM (VALUES {TEMPLATES}) v(t)),
              vals(col, v) AS (VALUES {VALUES}),
              corpus(t) AS (
                SELECT t FROM templates
                UNION ALL SELECT t || jsonb_build_object(a.col, a.v::jsonb) FROM templates, vals a
                UNION ALL SELECT t || jsonb_build_object(a.col, a.v::jsonb, b.col, b.v::jsonb)
                            FROM templates, vals a, vals b WHERE a.col < b.col)
         SELECT {} FROM corpus, jsonb_populate_record(NULL::events, t) e",
        columns.join(", ")
    );
    let row = client.query_one(&sql, &[]).await.expect("evaluate the corpus");
    let counts: Vec<i64> = (0..columns.len()).map(|i| row.get(i)).collect();
    let (disagree, accepted, rows, msg_rows) = (counts[0], counts[1], counts[2], counts[3]);
    let told_apart: serde_json::Map<String, serde_json::Value> =
        SEVENTEEN.iter().zip(&counts[4..]).map(|((name, _), n)| ((*name).to_owned(), json!(n))).collect();
    let pass = disagree == 0 && accepted > 0 && accepted < rows && msg_rows > 0 && counts[4..].iter().all(|n| *n > 0);
    record(
        "im-04",
        "04-events-rules-function-is-the-seventeen-rules",
        "sql",
        "over a corpus of events rows (a valid row of each kind with one or two columns set to null, edge or \
         forbidden values), event_rules_hold refuses exactly the rows the seventeen CHECKs of 0001-0015 refused; \
         negative controls: without any one of the seventeen, the others accept a row the function refuses",
        json!({"rows": rows, "msg_rows": msg_rows, "accepted": accepted, "disagreements": disagree,
               "refused_only_by_the_rule": told_apart}),
        pass,
    );
    assert!(pass);
}
