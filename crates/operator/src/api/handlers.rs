//! The operator API's routes: reads of what the BMDB knows, every operator action on a
//! machine (through `actions::perform`, as the CLI does), and API tokens. Bodies and queries
//! are strict: an unknown field is an error, not ignored.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};
use shepherd_bmdb::{
    Actor, ApiToken, AuditEvent, AuditFilter, AuditKind, Lifecycle, Operator, Process,
    ProviderKind, Role,
};
use uuid::Uuid;

use super::extract::{ApiJson, ApiQuery};
use super::policy::{parse_role, Principal};
use super::problem::{Kind, Problem};
use super::state::{Api, RequestId};
use crate::actions::{self, ActionError, InstallImage, MachineAction, Performed};
use crate::inventory;

/// Machines or tokens per page unless the query asks otherwise.
const DEFAULT_PAGE: usize = 100;
/// Largest page a query may ask for.
pub const MAX_PAGE: usize = 1000;
/// Machines scanned per request when a state filter matches few of them.
const SCAN_BUDGET: usize = 20_000;
/// Longest a token may be valid.
const MAX_TOKEN_DAYS: u64 = 3650;

type Reply = Result<Json<Value>, Problem>;

fn invalid(detail: impl Into<String>) -> Problem {
    Problem::new(Kind::InvalidRequest, detail)
}

fn machine_id(id: &str) -> Result<Uuid, Problem> {
    id.parse()
        .map_err(|_| invalid(format!("{id:?} is not a machine id (a UUID)")))
}

/// `GET /api/v1/machines` filters and paging.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    /// Only machines in this state (`provided`, `agent-starting`, `heartbeating`, `stale`,
    /// `in-backoff`, `in-work`, `installing`, `installed`, `maintenance`, `unprovided`).
    state: Option<String>,
    /// Only machines of this provider (`Static`, `Ironic`, `Sim` …).
    provider: Option<String>,
    /// Start after this machine id (the previous page's `next`).
    after: Option<Uuid>,
    /// Most machines in the page: 1 to 1000, 100 unless given.
    limit: Option<usize>,
}

/// `GET /api/v1/machines`: a page of machines in id order, with `next` to continue from.
pub async fn list_machines(State(api): State<Arc<Api>>, ApiQuery(q): ApiQuery<ListQuery>) -> Reply {
    let limit = q.limit.unwrap_or(DEFAULT_PAGE);
    if limit == 0 || limit > MAX_PAGE {
        return Err(invalid(format!("limit must be 1 to {MAX_PAGE}")));
    }
    let state: Option<Lifecycle> = q.state.as_deref().map(str::parse).transpose()?;
    let provider: Option<ProviderKind> = q.provider.as_deref().map(str::parse).transpose()?;
    let listing = inventory::list(
        &api.db,
        provider,
        state,
        q.after,
        limit,
        SCAN_BUDGET,
        api.stale_after,
    )
    .await
    .map_err(unavailable)?;
    let machines: Vec<Value> = listing
        .machines
        .iter()
        .map(|m| inventory::summary_json(m, listing.state_of(m)))
        .collect();
    Ok(Json(json!({ "machines": machines, "next": listing.next })))
}

fn unavailable(e: shepherd_bmdb::Error) -> Problem {
    Problem::new(Kind::Unavailable, e.to_string())
}

/// `GET /api/v1/machines/{id}`: everything about one machine.
pub async fn show_machine(State(api): State<Arc<Api>>, Path(id): Path<String>) -> Reply {
    let id = machine_id(&id)?;
    match inventory::detail(&api.db, id, api.stale_after)
        .await
        .map_err(unavailable)?
    {
        Some(detail) => Ok(Json(inventory::detail_json(&detail))),
        None => Err(Problem::new(
            Kind::NotFound,
            actions::no_such_machine(&api.db, id).await?,
        )),
    }
}

/// `GET /api/v1/machines/{id}/history`: the loops' and the operators' history, oldest first.
pub async fn machine_history(State(api): State<Arc<Api>>, Path(id): Path<String>) -> Reply {
    let id = machine_id(&id)?;
    let (lines, decommissioned) = inventory::history(&api.db, id).await.map_err(unavailable)?;
    let lines: Vec<Value> = lines.iter().map(inventory::history_line_json).collect();
    let decommissioned = decommissioned.map(|d| {
        json!({ "at": d.at, "by": d.by, "reason": d.reason, "provider": d.provider.as_str(),
                "provider_id": d.provider_id })
    });
    Ok(Json(
        json!({ "machine_id": id, "history": lines, "decommissioned": decommissioned }),
    ))
}

/// `GET /api/v1/sessions`: the BMDB's sessions and whether each is live.
pub async fn sessions(State(api): State<Arc<Api>>) -> Reply {
    let (list, now) = api
        .db
        .read(|tx| Box::pin(async move { Ok((tx.sessions().await?, tx.now().await?)) }))
        .await?;
    let list: Vec<Value> = list
        .iter()
        .map(|s| {
            json!({ "session_id": s.session_id, "component": s.component_name,
                    "processor": s.processor.as_str(), "deadline": s.deadline,
                    "live": s.deadline > now, "runtime": s.runtime_info })
        })
        .collect();
    Ok(Json(json!({ "sessions": list })))
}

/// `GET /api/v1/overview`: the fleet's counts by state, as the overview's chart names them.
pub async fn overview(State(api): State<Arc<Api>>) -> Reply {
    let counts = api.counts.get().await?;
    let series: serde_json::Map<String, Value> = counts
        .series()
        .into_iter()
        .map(|(name, n)| (name.to_string(), json!(n)))
        .collect();
    Ok(Json(json!({ "counts": series })))
}

/// `GET /api/v1/tasks`: this process's background tasks.
pub async fn tasks(State(api): State<Arc<Api>>) -> Reply {
    Ok(Json(crate::task_view::tasks_json(
        &api.tasks,
        chrono::Utc::now(),
    )))
}

/// `GET /api/v1/whoami`: the identity the request proved.
pub async fn whoami(Extension(who): Extension<Principal>) -> Reply {
    Ok(Json(json!({ "name": who.name, "role": who.role.as_str() })))
}

/// Performs `action` on machine `id` for `who` with `reason`, in request `request`.
async fn act(
    api: &Api,
    id: &str,
    action: MachineAction,
    reason: Option<String>,
    who: &Principal,
    request: &RequestId,
) -> Reply {
    let id = machine_id(id)?;
    // The body parsed; a reason it carries that cannot be recorded as it is (control
    // characters, too long) is unprocessable.
    let operator = Operator::new(who.name.clone(), reason.unwrap_or_default())
        .map_err(|e| Problem::new(Kind::Unprocessable, e.to_string()))?
        .in_request(request.0.clone());
    let performed = actions::perform(&api.db, "shepherd-api", id, action, &operator).await;
    let (changed, message) = match performed {
        Ok(Performed::Done(m)) => (true, m),
        Ok(Performed::Unchanged(m)) => (false, m),
        Err(ActionError::Invalid(m)) => return Err(invalid(m)),
        Err(ActionError::NoSuchMachine(m)) => return Err(Problem::new(Kind::NotFound, m)),
        Err(ActionError::Bmdb(e)) => return Err(e.into()),
    };
    Ok(Json(
        json!({ "machine_id": id, "changed": changed, "message": message,
                    "request_id": request.0 }),
    ))
}

/// The body of an action route: what it asks, and why (for the history).
pub trait ActionBody: DeserializeOwned + Send + 'static {
    /// The action and the reason it gives.
    fn action(self) -> Result<(MachineAction, Option<String>), Problem>;
}

/// `POST /api/v1/machines/{id}/…`: performs the action its body `B` asks for, recorded under
/// the request's identity and id.
pub async fn action<B: ActionBody>(
    State(api): State<Arc<Api>>,
    Path(id): Path<String>,
    Extension(who): Extension<Principal>,
    Extension(request): Extension<RequestId>,
    ApiJson(body): ApiJson<B>,
) -> Reply {
    let (action, reason) = body.action()?;
    act(&api, &id, action, reason, &who, &request).await
}

/// `…/maintenance`: `on` takes the machine out of the loops' hands, `off` gives it back.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MaintenanceBody {
    /// In maintenance (true) or back to the loops (false).
    on: bool,
    /// Why, for the machine's history; needed to turn maintenance on.
    reason: Option<String>,
}

impl ActionBody for MaintenanceBody {
    fn action(self) -> Result<(MachineAction, Option<String>), Problem> {
        let action = match self.on {
            true => MachineAction::MaintenanceOn,
            false => MachineAction::MaintenanceOff,
        };
        Ok((action, self.reason))
    }
}

/// `…/retry`: ends the machine's backoffs (of `process`, or all) now.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RetryBody {
    /// Only this process's backoff (`ShepherdAccess`, `ShepherdAgentStart`,
    /// `ShepherdRecovery`); all if absent.
    process: Option<String>,
    /// Why, for the machine's history.
    reason: Option<String>,
}

impl ActionBody for RetryBody {
    fn action(self) -> Result<(MachineAction, Option<String>), Problem> {
        let process: Option<Process> = self.process.as_deref().map(str::parse).transpose()?;
        Ok((MachineAction::Retry { process }, self.reason))
    }
}

/// The body of an action that needs nothing but a reason: the action is `A`'s.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Because<A> {
    reason: Option<String>,
    #[serde(skip)]
    action: std::marker::PhantomData<A>,
}

/// An action that takes no parameters.
pub trait PlainAction: Send + 'static {
    /// The action.
    const ACTION: MachineAction;
}

impl<A: PlainAction> ActionBody for Because<A> {
    fn action(self) -> Result<(MachineAction, Option<String>), Problem> {
        Ok((A::ACTION, self.reason))
    }
}

/// `…/forget-host-key`.
#[derive(Debug)]
pub struct ForgetHostKey;

impl PlainAction for ForgetHostKey {
    const ACTION: MachineAction = MachineAction::ForgetHostKey;
}

/// `…/recommission`.
#[derive(Debug)]
pub struct Recommission;

impl PlainAction for Recommission {
    const ACTION: MachineAction = MachineAction::Recommission;
}

/// `…/decommission`: removes the machine from the BMDB (and, with `undeploy`, tears it
/// down at its provider).
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DecommissionBody {
    /// Also tear the machine down at its provider (its disks are lost).
    #[serde(default)]
    undeploy: bool,
    /// Why, for the machine's history; needed.
    reason: Option<String>,
}

impl ActionBody for DecommissionBody {
    fn action(self) -> Result<(MachineAction, Option<String>), Problem> {
        let undeploy = self.undeploy;
        Ok((MachineAction::Decommission { undeploy }, self.reason))
    }
}

/// `…/install`: asks the machine's agent to install an image.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct InstallBody {
    /// The image's http(s) URL.
    image: String,
    /// Its SHA-256, 64 hex digits.
    sha256: String,
    /// The block device it is written to.
    device: String,
    /// The device may be overwritten although it holds a partition table or a file system.
    #[serde(default)]
    wipe: bool,
    /// Why, for the machine's history.
    reason: Option<String>,
}

impl ActionBody for InstallBody {
    fn action(self) -> Result<(MachineAction, Option<String>), Problem> {
        let image = InstallImage::new(self.image, self.sha256, self.device, self.wipe)
            .map_err(|e| invalid(e.to_string()))?;
        Ok((MachineAction::Install(image), self.reason))
    }
}

/// `…/reimage`: sends a machine that came bare back to its live environment.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReimageBody {
    /// Why, for the machine's history (required).
    reason: Option<String>,
    /// Its disk may be overwritten although it holds an OS.
    #[serde(default)]
    wipe: bool,
}

impl ActionBody for ReimageBody {
    fn action(self) -> Result<(MachineAction, Option<String>), Problem> {
        Ok((MachineAction::Reimage { wipe: self.wipe }, self.reason))
    }
}

fn token_json(t: &ApiToken) -> Value {
    json!({ "name": t.name, "role": t.role.as_str(), "created_at": t.times.created_at,
            "created_by": t.created_by, "expires_at": t.times.expires_at,
            "revoked_at": t.times.revoked_at, "last_used_at": t.times.last_used_at })
}

/// `GET /api/v1/tokens` paging.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct TokensQuery {
    /// Start after this token name (the previous page's `next`).
    after: Option<String>,
    /// Most tokens in the page: 1 to 1000, 100 unless given.
    limit: Option<usize>,
}

/// `GET /api/v1/tokens`: a page of tokens by name (never a secret), with `next` to continue
/// from.
pub async fn list_tokens(State(api): State<Arc<Api>>, ApiQuery(q): ApiQuery<TokensQuery>) -> Reply {
    let limit = q.limit.unwrap_or(DEFAULT_PAGE);
    let (tokens, next) = api.db.api_tokens(q.after.as_deref(), limit).await?;
    let tokens: Vec<Value> = tokens.iter().map(token_json).collect();
    Ok(Json(json!({ "tokens": tokens, "next": next })))
}

/// `GET /api/v1/audit` filters and paging.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct AuditQuery {
    /// Only this principal's events (`token:ci`, `oidc:SUBJECT@ISSUER`).
    principal: Option<String>,
    /// Only events of this kind: SignIn, SignOut, TokenCreated, TokenRevoked,
    /// SessionsRevoked or Refused.
    kind: Option<String>,
    /// Only events seen at or after this time (RFC 3339).
    since: Option<String>,
    /// Only events older than this id (the previous page's `next`).
    before: Option<i64>,
    /// Most events in the page: 1 to 1000, 100 unless given.
    limit: Option<usize>,
}

impl AuditQuery {
    /// The filter the query asks for; a clear error for a kind or time that is not one.
    pub fn filter(&self) -> Result<AuditFilter, Problem> {
        let kind = self
            .kind
            .as_deref()
            .map(|k| k.parse::<AuditKind>())
            .transpose()
            .map_err(|e| invalid(format!("kind: {e}")))?;
        let since = self
            .since
            .as_deref()
            .map(chrono::DateTime::parse_from_rfc3339)
            .transpose()
            .map_err(|e| invalid(format!("since: not an RFC 3339 time ({e})")))?
            .map(|t| t.with_timezone(&chrono::Utc));
        Ok(AuditFilter {
            principal: self.principal.clone(),
            kind,
            since,
        })
    }
}

/// An audit event as the API shows it.
pub fn audit_json(e: &AuditEvent) -> Value {
    json!({ "id": e.id, "at": e.at, "kind": e.kind.as_str(), "principal": e.principal,
            "peer": e.peer, "route": e.route, "reason": e.reason, "request_id": e.request_id })
}

/// `GET /api/v1/audit`: a page of the security audit trail, newest first, with `next` (the
/// `before` of the next page) if more follow.
pub async fn audit(State(api): State<Arc<Api>>, ApiQuery(q): ApiQuery<AuditQuery>) -> Reply {
    let filter = q.filter()?;
    let limit = q.limit.unwrap_or(DEFAULT_PAGE);
    let (events, next) = api.db.audit_events(&filter, q.before, limit).await?;
    let events: Vec<Value> = events.iter().map(audit_json).collect();
    Ok(Json(json!({ "events": events, "next": next })))
}

/// `POST /api/v1/tokens`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewTokenBody {
    /// Its name, unique and never reused: who it is in the operators' history.
    name: String,
    /// `viewer`, `operator` or `admin`.
    role: String,
    /// How long it is valid, 1 to 3650 days.
    expires_in_days: u64,
}

/// `POST /api/v1/tokens`: makes a token; its secret is in this answer and nowhere else.
pub async fn create_token(
    State(api): State<Arc<Api>>,
    Extension(who): Extension<Actor>,
    ApiJson(body): ApiJson<NewTokenBody>,
) -> Result<(StatusCode, Json<Value>), Problem> {
    let role: Role = parse_role(&body.role).map_err(|e| invalid(e.to_string()))?;
    if body.expires_in_days == 0 || body.expires_in_days > MAX_TOKEN_DAYS {
        return Err(invalid(format!(
            "expires_in_days must be 1 to {MAX_TOKEN_DAYS}"
        )));
    }
    let valid_for = std::time::Duration::from_secs(body.expires_in_days * 86_400);
    let made = api
        .db
        .create_api_token(&body.name, role, valid_for, &who)
        .await?;
    let Some((token, secret)) = made else {
        let taken = format!(
            "a token named {:?} exists (names are never reused)",
            body.name
        );
        return Err(Problem::new(Kind::Conflict, taken));
    };
    let mut answer = token_json(&token);
    answer["secret"] = json!(secret.reveal());
    Ok((StatusCode::CREATED, Json(answer)))
}

/// `POST /api/v1/tokens/revoke-sessions`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RevokeSessionsBody {
    /// Whose web sign-ins: the person as the history names them (`oidc:SUBJECT@ISSUER`).
    of: String,
}

/// `POST /api/v1/tokens/revoke-sessions`: revokes every web sign-in of one person.
pub async fn revoke_sessions(
    State(api): State<Arc<Api>>,
    Extension(who): Extension<Actor>,
    ApiJson(body): ApiJson<RevokeSessionsBody>,
) -> Reply {
    if body.of.trim().is_empty() {
        return Err(invalid("of: whose sign-ins (oidc:SUBJECT@ISSUER)"));
    }
    let revoked = api.db.revoke_sessions_of(&body.of, &who).await?;
    api.auth.forget_cached();
    Ok(Json(json!({ "of": body.of, "revoked": revoked })))
}

/// `DELETE /api/v1/tokens/{name}`: revokes a token.
pub async fn revoke_token(
    State(api): State<Arc<Api>>,
    Extension(who): Extension<Actor>,
    Path(name): Path<String>,
) -> Reply {
    let Some(token) = api.db.revoke_api_token(&name, &who).await? else {
        return Err(Problem::new(
            Kind::NotFound,
            format!("no token named {name:?}"),
        ));
    };
    api.auth.forget_cached();
    Ok(Json(token_json(&token)))
}
