//! The Conversations API: `conv_...` objects holding an ordered list of items, which a response
//! created with `conversation` reads as its history and extends with its input and output.
//!
//! | method and path | answer |
//! |---|---|
//! | `POST /v1/conversations` (`items` up to 20, `metadata`) | the conversation |
//! | `GET /v1/conversations/{id}` | the conversation |
//! | `POST /v1/conversations/{id}` (`metadata`) | the conversation, metadata replaced |
//! | `DELETE /v1/conversations/{id}` | `{id, object: "conversation.deleted", deleted: true}` |
//! | `GET /v1/conversations/{id}/items` (`limit`, `order`, `after`) | a page of items |
//! | `POST /v1/conversations/{id}/items` (`items` up to 20) | the items added, as a list |
//! | `GET /v1/conversations/{id}/items/{item_id}` | the item |
//! | `DELETE /v1/conversations/{id}/items/{item_id}` | the conversation |
//!
//! Conversations live in the store beside responses (Redis when configured, so every gateway
//! replica sees them; in memory they count toward `store.memory_max_mb` and are dropped least
//! recently used first, like responses), scoped to the team whose key created them (404 for
//! others), with the store's TTL refreshed on every use. Items are normalized as response input is: every item gets an
//! `id`, shapes are checked and errors name the path (`items[2].role`).
//!
//! With `conversation` (an id, or `{"id": ...}`), `POST /v1/responses` loads the items as the
//! turn's history (one store round trip) and, once the response has `completed` or is
//! `incomplete`, appends the turn's input items and output items before the terminal event is
//! sent, so the next turn sees them (once: a retried write does not add them again; a
//! background response cancelled meanwhile adds nothing).
//!
//! One turn at a time: a response in a conversation holds the conversation's lock in the store
//! ([`ConversationLock`]) from before it reads the items until its own are appended (a
//! background response from its creation), and `POST .../items` holds it while it checks and
//! appends. Another response or append meanwhile is refused 400 `conversation_locked` (`param:
//! conversation`), as OpenAI refuses it, instead of building on a snapshot the running turn is
//! about to extend (after a short wait, `TAKE_RETRIES`: the lock is released a store round
//! trip after a client may have seen its turn end). A cancel releases a background response's
//! lock at once ([`release_for`]). The lock lives in the store, so it holds across gateway replicas; its TTL
//! ([`LOCK_TTL`], renewed while the turn runs) frees the conversation of a gateway that died
//! holding it. The session key
//! of such turns is the conversation id (`agentgate_scheduler::session_key`), so they go to the
//! replica holding the conversation's cache (unless a session header or `prompt_cache_key`
//! names the session first).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::Json;
use serde_json::{json, Value};
use tokio::task::JoinHandle;

use agentgate_adapters::normalize_input;
use agentgate_sessions::{AnyStore, ConversationRecord, Store};

use crate::app::AppState;
use crate::auth::Team;
use crate::error::HttpError;
use crate::request::{invalid_type, parse_json_body, validate_metadata};
use crate::response_object::{new_id, now_secs};
use crate::responses::{
    as_listed, body_error, duplicate_item, item_list, item_page, store_error, ListQuery,
};

/// How long a conversation's lock outlives its holder's last renewal: the longest a gateway
/// that dies mid-turn keeps its conversations locked.
pub const LOCK_TTL: Duration = Duration::from_secs(30);

/// Pauses between tries to take a held lock before refusing (about 0.8 s in all): a turn
/// releases it a store round trip or two after its client may have seen it end (a background
/// response's record says `completed` just before its items are appended; a cancel on another
/// replica is seen at its run's next event-log write), and a client that starts the next turn
/// at once should not be refused for that.
const TAKE_RETRIES: [Duration; 5] = [
    Duration::from_millis(25),
    Duration::from_millis(50),
    Duration::from_millis(100),
    Duration::from_millis(200),
    Duration::from_millis(400),
];

/// The lock of one conversation, held by one turn (or one item append) until released or
/// its last clone dropped (see the module docs). A task renews it every third of [`LOCK_TTL`].
#[derive(Clone)]
pub struct ConversationLock(Arc<LockHolder>);

struct LockHolder {
    store: Arc<AnyStore>,
    team: String,
    id: String,
    owner: String,
    /// The owner is a response stored from the start (a background one): once its record is
    /// gone (deleted), its lock is not taken back.
    recorded: bool,
    /// The renewing task; `None` once released.
    keeper: std::sync::Mutex<Option<JoinHandle<()>>>,
}

impl ConversationLock {
    /// Take conversation `id`'s lock for `owner`; 400 `conversation_locked` while another
    /// turn holds it (after `TAKE_RETRIES`). The store calls run in a task of their own, so
    /// a client that leaves meanwhile cannot leave the lock taken with no holder: the task's
    /// lock is then dropped, which releases it.
    pub async fn take(
        store: &Arc<AnyStore>,
        team: &Team,
        id: &str,
        owner: &str,
        recorded: bool,
    ) -> Result<ConversationLock, HttpError> {
        let holder = LockHolder {
            store: store.clone(),
            team: team.0.clone(),
            id: id.to_string(),
            owner: owner.to_string(),
            recorded,
            keeper: std::sync::Mutex::new(None),
        };
        tokio::spawn(holder.take()).await.unwrap_or_else(|e| {
            Err(HttpError::server(
                500,
                format!("Taking the conversation's lock failed: {e}."),
                "server_error",
            ))
        })
    }

    /// Release the lock now, in the store (once; later calls do nothing), before the caller
    /// tells its client the turn is over: a client may start the next turn the moment it
    /// reads that. The release runs in a task of its own, so it happens even if the caller is
    /// dropped while waiting for it.
    pub async fn release(&self) {
        if let Some(keeper) = self.0.take_keeper() {
            let holder = self.0.detached();
            let _ = tokio::spawn(async move { holder.unlock(keeper).await }).await;
        }
    }
}

/// Release, for a background response `owner` cancelled while it ran or waited in
/// conversation `id`, the lock its run holds: a cancelled response adds nothing to the
/// conversation, and its run (maybe on another replica) may take a while to notice. The run
/// renews only a lock it still holds, and takes a lost one back only while its response is
/// not cancelled (`keep`).
pub async fn release_for(state: &AppState, team: &str, response: &Value, owner: &str) {
    let Some(id) = response.pointer("/conversation/id").and_then(Value::as_str) else {
        return;
    };
    if let Err(e) = state.store.unlock_conversation(team, id, owner).await {
        tracing::warn!(conversation = %id, response = %owner, "could not release the conversation's lock (it expires by itself): {e}");
    }
}

impl LockHolder {
    /// Take the lock (see [`ConversationLock::take`]) and start renewing it.
    async fn take(self) -> Result<ConversationLock, HttpError> {
        let mut pauses = TAKE_RETRIES.iter();
        loop {
            let taken = match self
                .store
                .lock_conversation(&self.team, &self.id, &self.owner, LOCK_TTL, false)
                .await
            {
                Ok(taken) => taken,
                Err(e) => {
                    // The call may have taken it and only its reply been lost.
                    let _ = self
                        .store
                        .unlock_conversation(&self.team, &self.id, &self.owner)
                        .await;
                    return Err(store_error(e));
                }
            };
            if taken {
                break;
            }
            match pauses.next() {
                Some(pause) => tokio::time::sleep(*pause).await,
                None => {
                    return Err(HttpError::invalid(
                        format!(
                            "Another request is running in conversation '{}' (a response, or \
                             items being added); retry once it has finished.",
                            self.id
                        ),
                        Some("conversation"),
                        Some("conversation_locked"),
                    ))
                }
            }
        }
        let keeper = {
            let (store, team, id, owner) = (
                self.store.clone(),
                self.team.clone(),
                self.id.clone(),
                self.owner.clone(),
            );
            tokio::spawn(keep(store, team, id, owner, self.recorded))
        };
        *self
            .keeper
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(keeper);
        Ok(ConversationLock(Arc::new(self)))
    }

    fn take_keeper(&self) -> Option<JoinHandle<()>> {
        self.keeper
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take()
    }

    /// The same lock's names, without its renewing task (for a task that releases it).
    fn detached(&self) -> LockHolder {
        LockHolder {
            store: self.store.clone(),
            team: self.team.clone(),
            id: self.id.clone(),
            owner: self.owner.clone(),
            recorded: self.recorded,
            keeper: std::sync::Mutex::new(None),
        }
    }

    /// Stop `keeper` renewing the lock, then release it. A renewal already sent may still
    /// land after the release; it renews only a lock its owner holds, so it does nothing.
    async fn unlock(&self, keeper: JoinHandle<()>) {
        keeper.abort();
        let _ = keeper.await;
        if let Err(e) = self
            .store
            .unlock_conversation(&self.team, &self.id, &self.owner)
            .await
        {
            tracing::warn!(conversation = %self.id, response = %self.owner, "could not release the conversation's lock (it expires by itself): {e}");
        }
    }
}

/// Renew `owner`'s lock every third of [`LOCK_TTL`] until aborted. A renewal that finds the
/// lock no longer `owner`'s stops, when its response was cancelled or deleted ([`release_for`]
/// released it; a deleted one only when `recorded`, its record kept from the start) or another
/// request holds it now; a lock that expired while the store was out of reach is taken back if
/// still free.
async fn keep(store: Arc<AnyStore>, team: String, id: String, owner: String, recorded: bool) {
    loop {
        tokio::time::sleep(LOCK_TTL / 3).await;
        match store
            .lock_conversation(&team, &id, &owner, LOCK_TTL, true)
            .await
        {
            Ok(true) => continue,
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(conversation = %id, response = %owner, "could not renew the conversation's lock: {e}");
                continue;
            }
        }
        match store.status(&team, &owner).await {
            Ok(Some(status)) if status == "cancelled" => return,
            // Deleted: a delete gives the lock back as a cancel does.
            Ok(None) if recorded => return,
            _ => {}
        }
        match store
            .lock_conversation(&team, &id, &owner, LOCK_TTL, false)
            .await
        {
            Ok(true) => {
                tracing::warn!(conversation = %id, response = %owner, "the conversation's lock expired while its turn ran (the store was out of reach); taken again")
            }
            Ok(false) => {
                tracing::warn!(conversation = %id, response = %owner, "the conversation's lock expired while its turn ran, and another request holds it now");
                return;
            }
            Err(e) => {
                tracing::warn!(conversation = %id, response = %owner, "could not take the conversation's lock again: {e}")
            }
        }
    }
}

impl Drop for LockHolder {
    /// A lock nobody released (its turn ended another way) is released from a task; outside
    /// a runtime, its TTL frees it.
    fn drop(&mut self) {
        let Some(keeper) = self.take_keeper() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            keeper.abort();
            return;
        };
        let holder = self.detached();
        runtime.spawn(async move { holder.unlock(keeper).await });
    }
}

/// Most items one create or add request may carry (OpenAI's limit).
pub const MAX_ITEMS_PER_REQUEST: usize = 20;

/// The conversation object clients see.
fn object(record: &ConversationRecord) -> Value {
    json!({
        "id": record.id,
        "object": "conversation",
        "created_at": record.created_at,
        "metadata": record.metadata,
    })
}

/// 404 for a conversation that does not exist (or is another team's).
pub fn not_found(id: &str) -> HttpError {
    HttpError::new(
        404,
        "invalid_request_error",
        format!("Conversation with id '{id}' not found."),
        None,
        Some("not_found"),
    )
}

async fn body_of(
    state: &AppState,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<serde_json::Map<String, Value>, HttpError> {
    let bytes = body.map_err(|r| body_error(r, state.config.server.max_body_bytes))?;
    match parse_json_body(headers, &bytes, state.config.server.parse_inline_bytes).await? {
        Value::Object(fields) => Ok(fields),
        _ => Err(HttpError::invalid(
            "The request body must be a JSON object.",
            None,
            Some("invalid_type"),
        )),
    }
}

/// `items` of a create or add body, normalized; `required` for add.
fn items_of(
    fields: &serde_json::Map<String, Value>,
    required: bool,
) -> Result<Vec<Value>, HttpError> {
    let items = match fields.get("items") {
        None | Some(Value::Null) if !required => return Ok(Vec::new()),
        None | Some(Value::Null) => {
            return Err(HttpError::invalid(
                "Missing required parameter: 'items'.",
                Some("items"),
                Some("missing_required_parameter"),
            ))
        }
        // Adding nothing is a client's mistake (and a list of nothing has no first or last id).
        Some(Value::Array(items)) if items.is_empty() && required => {
            return Err(HttpError::invalid(
                "Invalid 'items': empty array. Expected an array with minimum length 1, but got an empty array instead.",
                Some("items"),
                Some("empty_array"),
            ))
        }
        Some(Value::Array(items)) => items,
        Some(_) => return Err(invalid_type("items", "an array")),
    };
    if items.len() > MAX_ITEMS_PER_REQUEST {
        return Err(HttpError::invalid(
            format!(
                "Invalid 'items': at most {MAX_ITEMS_PER_REQUEST} items may be added at once, got {}.",
                items.len()
            ),
            Some("items"),
            Some("array_above_max_length"),
        ));
    }
    let items = normalize_input(&Value::Array(items.clone())).map_err(|e| {
        let mut error = HttpError::from(e);
        if let Some(param) = error.error.param.as_mut() {
            if let Some(rest) = param.strip_prefix("input") {
                *param = format!("items{rest}");
            }
        }
        error.error.message = error.error.message.replace("input[", "items[");
        error
    })?;
    for (index, item) in items.iter().enumerate() {
        let refused = match item.get("type").and_then(Value::as_str) {
            Some("compaction_trigger") => {
                "a compaction_trigger is a request control, not a conversation item"
            }
            Some("item_reference") => {
                "an item_reference cannot be kept in a conversation; add the item itself"
            }
            _ => continue,
        };
        return Err(HttpError::invalid(
            format!("Invalid 'items[{index}]': {refused}."),
            Some(&format!("items[{index}].type")),
            Some("invalid_value"),
        ));
    }
    // Instructions hold text: an image, file or audio part in one would be dropped at every
    // turn, so it is refused here, as in a request's input.
    for (index, item) in items.iter().enumerate() {
        if let Some((part, kind)) = agentgate_adapters::instruction_media(item) {
            let role = item.get("role").and_then(Value::as_str).unwrap_or("system");
            return Err(HttpError::invalid(
                format!("Invalid 'items[{index}]': a {role} message holds text only; add the {kind} in a user message."),
                Some(&format!("items[{index}].content[{part}].type")),
                Some("invalid_value"),
            ));
        }
    }
    check_new_ids(&[], &items)?;
    Ok(items)
}

/// An item whose id `held` (a conversation's items) already has, or that `items` gives twice,
/// is refused as OpenAI refuses it: two items with one id would make `after=<id>` pagination
/// repeat or loop.
fn check_new_ids(held: &[Value], items: &[Value]) -> Result<(), HttpError> {
    fn id_of(item: &Value) -> Option<&str> {
        item.get("id").and_then(Value::as_str)
    }
    let mut ids: HashSet<&str> = held.iter().filter_map(id_of).collect();
    for id in items.iter().filter_map(id_of) {
        if !ids.insert(id) {
            return Err(duplicate_item(id, "items"));
        }
    }
    Ok(())
}

async fn load(state: &AppState, team: &Team, id: &str) -> Result<ConversationRecord, HttpError> {
    state
        .store
        .get_conversation(&team.0, id)
        .await
        .map_err(store_error)?
        .ok_or_else(|| not_found(id))
}

/// `POST /v1/conversations`.
pub async fn create(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, HttpError> {
    let team = state.keys.authenticate(&headers)?;
    let fields = body_of(&state, &headers, body).await?;
    validate_metadata(fields.get("metadata"))?;
    let items = items_of(&fields, false)?;
    let record = ConversationRecord {
        id: new_id("conv"),
        team: team.0,
        created_at: u64::try_from(now_secs()).unwrap_or(0),
        metadata: fields
            .get("metadata")
            .filter(|m| m.is_object())
            .cloned()
            .unwrap_or_else(|| json!({})),
    };
    state
        .store
        .create_conversation(&record, &items)
        .await
        .map_err(store_error)?;
    Ok(Json(object(&record)))
}

/// `GET /v1/conversations/{id}`.
pub async fn retrieve(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<Value>, HttpError> {
    let team = state.keys.authenticate(&headers)?;
    Ok(Json(object(&load(&state, &team, &id).await?)))
}

/// `POST /v1/conversations/{id}`: replace the metadata.
pub async fn update(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, HttpError> {
    let team = state.keys.authenticate(&headers)?;
    let fields = body_of(&state, &headers, body).await?;
    let metadata = match fields.get("metadata") {
        Some(m @ Value::Object(_)) => m.clone(),
        // The SDK sends null for "no metadata": clear it.
        Some(Value::Null) => json!({}),
        None => {
            return Err(HttpError::invalid(
                "Missing required parameter: 'metadata'.",
                Some("metadata"),
                Some("missing_required_parameter"),
            ))
        }
        Some(_) => return Err(invalid_type("metadata", "an object")),
    };
    validate_metadata(Some(&metadata))?;
    let record = state
        .store
        .set_conversation_metadata(&team.0, &id, &metadata)
        .await
        .map_err(store_error)?
        .ok_or_else(|| not_found(&id))?;
    Ok(Json(object(&record)))
}

/// `DELETE /v1/conversations/{id}` (its items go too; responses created in it stay).
pub async fn delete(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<Value>, HttpError> {
    let team = state.keys.authenticate(&headers)?;
    if !state
        .store
        .delete_conversation(&team.0, &id)
        .await
        .map_err(store_error)?
    {
        return Err(not_found(&id));
    }
    Ok(Json(
        json!({"id": id, "object": "conversation.deleted", "deleted": true}),
    ))
}

/// Every item of conversation `id`, oldest first, or 404.
pub async fn items(state: &AppState, team: &Team, id: &str) -> Result<Vec<Value>, HttpError> {
    state
        .store
        .conversation_items(&team.0, id)
        .await
        .map_err(store_error)?
        .ok_or_else(|| not_found(id))
}

/// `GET /v1/conversations/{id}/items`.
pub async fn list_items(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(q): Query<ListQuery>,
) -> Result<Json<Value>, HttpError> {
    let team = state.keys.authenticate(&headers)?;
    let items = items(&state, &team, &id).await?;
    Ok(Json(item_page(items, &q, "this conversation")?))
}

/// `POST /v1/conversations/{id}/items`: append; answers the items added.
pub async fn add_items(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, HttpError> {
    let team = state.keys.authenticate(&headers)?;
    let fields = body_of(&state, &headers, body).await?;
    let items = items_of(&fields, true)?;
    // Checked and appended under the conversation's lock: not between a running turn's read
    // of the items and the append of its own. Released before the answer, so the client's
    // next request finds it free.
    let lock = ConversationLock::take(&state.store, &team, &id, &new_id("append"), false).await?;
    let added = append_items(&state, &team, &id, &fields, items).await;
    lock.release().await;
    added
}

/// The checks and the append of [`add_items`], under the conversation's lock.
async fn append_items(
    state: &AppState,
    team: &Team,
    id: &str,
    fields: &serde_json::Map<String, Value>,
    items: Vec<Value>,
) -> Result<Json<Value>, HttpError> {
    // Ids the client chose are checked against the conversation's; ids made here are new.
    let chosen_ids = fields
        .get("items")
        .and_then(Value::as_array)
        .is_some_and(|sent| sent.iter().any(|item| item.get("id").is_some()));
    if chosen_ids {
        let held = self::items(state, team, id).await?;
        check_new_ids(&held, &items)?;
        check_room(state, id, held.len(), items.len(), "items")?;
    } else if state.config.store.conversation_max_items > 0 {
        let held = state
            .store
            .conversation_len(&team.0, id)
            .await
            .map_err(store_error)?
            .ok_or_else(|| not_found(id))?;
        check_room(state, id, held, items.len(), "items")?;
    }
    if !state
        .store
        .append_conversation_items(&team.0, id, "", &items)
        .await
        .map_err(store_error)?
    {
        return Err(not_found(id));
    }
    Ok(Json(item_list(items, false)))
}

/// Whether conversation `id`, holding `held` items, may take `adding` more under
/// `[store] conversation_max_items` (a response in it adds none up front: its own items may
/// take it past the bound by one turn); else 400 `conversation_full` on `param`.
pub fn check_room(
    state: &AppState,
    id: &str,
    held: usize,
    adding: usize,
    param: &str,
) -> Result<(), HttpError> {
    let max = state.config.store.conversation_max_items;
    if max == 0 || held.saturating_add(adding.max(1)) <= max {
        return Ok(());
    }
    Err(HttpError::invalid(
        format!(
            "Conversation '{id}' holds {held} items, and this gateway keeps at most {max} in one \
             conversation: start a new conversation, or delete items from this one."
        ),
        Some(param),
        Some("conversation_full"),
    ))
}

fn item_not_found(id: &str, item_id: &str) -> HttpError {
    HttpError::new(
        404,
        "invalid_request_error",
        format!("Item with id '{item_id}' not found in conversation '{id}'."),
        None,
        Some("not_found"),
    )
}

/// `GET /v1/conversations/{id}/items/{item_id}`.
pub async fn get_item(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path((id, item_id)): Path<(String, String)>,
) -> Result<Json<Value>, HttpError> {
    let team = state.keys.authenticate(&headers)?;
    items(&state, &team, &id)
        .await?
        .into_iter()
        .find(|item| item.get("id").and_then(Value::as_str) == Some(item_id.as_str()))
        .map(|item| Json(as_listed(item)))
        .ok_or_else(|| item_not_found(&id, &item_id))
}

/// `DELETE /v1/conversations/{id}/items/{item_id}`: answers the conversation.
pub async fn delete_item(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path((id, item_id)): Path<(String, String)>,
) -> Result<Json<Value>, HttpError> {
    let team = state.keys.authenticate(&headers)?;
    match state
        .store
        .delete_conversation_item(&team.0, &id, &item_id)
        .await
        .map_err(store_error)?
    {
        None => Err(not_found(&id)),
        Some(false) => Err(item_not_found(&id, &item_id)),
        Some(true) => Ok(Json(object(&load(&state, &team, &id).await?))),
    }
}
