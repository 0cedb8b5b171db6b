// The agentd console: one page over the JSON API (docs/guides/console.md).
// Three views, chosen by the URL's fragment: the tasks (#/), a task (#/tasks/ID) and the
// inbox of held calls (#/inbox). Rows arrive live from GET /api/stream (server-sent
// events, one per change of a task's row); every action is a POST with the session's
// CSRF token, answered as the CLI would: the error's one line is shown as it is.
// Nothing here writes HTML from data: every text goes in through textContent.
"use strict";

const state = {
  csrf: "",
  by: "",
  rows: new Map(), // task id -> its row, as GET /api/tasks and the stream give it
  view: null, // {name, task}
  refresh: null, // the open view's reload, called when a row it shows changes
  timer: 0,
};

// -- little helpers -------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key === "class") node.className = value;
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function json(value) {
  return JSON.stringify(value, null, 2);
}

function tokens(usage) {
  const n = (usage?.input_tokens || 0) + (usage?.output_tokens || 0);
  return n < 10000 ? String(n) : n < 1e6 ? `${(n / 1000).toFixed(1)}k` : `${(n / 1e6).toFixed(1)}M`;
}

function badge(text, kind) {
  return el("span", { class: `badge ${kind || text}` }, text);
}

function flash(text, kind) {
  const box = document.getElementById("flash");
  box.textContent = text;
  box.className = kind || "info";
  box.hidden = !text;
}

async function api(method, path, body) {
  const options = { method, headers: { Accept: "application/json" }, credentials: "same-origin" };
  if (method === "POST") {
    options.headers["Content-Type"] = "application/json";
    options.headers["X-CSRF-Token"] = state.csrf;
    options.body = JSON.stringify(body || {});
  }
  const response = await fetch(path, options);
  let data = null;
  try {
    data = await response.json();
  } catch (_) {
    data = { error: `${response.status} ${response.statusText}` };
  }
  if (response.status === 401) {
    flash("Your session has ended: `agentd console` prints a new login link.", "error");
  }
  return { status: response.status, ok: response.ok, data };
}

// An action's POST: its answer flashed, the view reloaded.
async function act(path, body, done) {
  const answer = await api("POST", path, body);
  if (answer.ok) {
    flash(done, "ok");
  } else {
    flash(answer.data.error, "error");
  }
  if (state.refresh) state.refresh(true);
  return answer;
}

// -- live rows ------------------------------------------------------------------------

function listen() {
  const live = document.getElementById("live");
  const source = new EventSource("/api/stream");
  source.addEventListener("open", () => {
    live.textContent = "live";
    live.className = "live on";
  });
  source.addEventListener("error", () => {
    live.textContent = "reconnecting";
    live.className = "live";
  });
  source.addEventListener("task", (event) => {
    const row = JSON.parse(event.data);
    const before = state.rows.get(row.id);
    state.rows.set(row.id, row);
    countHeld();
    if (state.view?.name === "tasks") {
      renderRow(row);
    } else if (state.view?.name === "task" && state.view.task === row.id && moved(before, row)) {
      later(state.refresh, 1000);
    } else if (state.view?.name === "inbox" && (row.state === "held" || before?.state === "held")) {
      later(state.refresh, 500);
    }
  });
}

// Reload a view at most once a while, however many rows change meanwhile.
function later(fn, wait) {
  if (!fn || state.timer) return;
  state.timer = setTimeout(() => {
    state.timer = 0;
    fn(true);
  }, wait);
}

// Whether a task's page has something new to show (a heartbeat's age is nothing new).
function moved(before, row) {
  if (!before) return true;
  const keys = ["state", "turn", "reason", "compactions", "restarts", "cost_usd"];
  return keys.some((k) => before[k] !== row[k]) || (before.dangling || []).length !== (row.dangling || []).length;
}

function countHeld() {
  let held = 0;
  for (const row of state.rows.values()) held += (row.dangling || []).length;
  const count = document.getElementById("inbox-count");
  count.textContent = String(held);
  count.hidden = held === 0;
}

// -- the tasks ------------------------------------------------------------------------

const COLUMNS = ["Task", "State", "Turn", "Tokens", "Cost", "Context", "Restarts", "Node", "Heartbeat", "Phase", "Reason"];

// The spend in dollars to the cent (a smaller one to four places), "-" when a model has no
// price, and "/" the USD budget when there is one: as `agentd status` shows it.
function cost(row) {
  const spent = row.cost_usd;
  const shown = typeof spent !== "number" ? "-" : spent >= 0.01 || spent === 0 ? `$${spent.toFixed(2)}` : `$${spent.toFixed(4)}`;
  const budget = row.budget?.usd;
  return typeof budget === "number" ? `${shown}/${budget.toFixed(2)}` : shown;
}

function taskCells(row) {
  const beat = row.heartbeat_age;
  const reason = row.dangling?.length ? `${row.dangling.length} held call(s)` : row.reason || "";
  return [
    el("td", {}, el("a", { href: `#/tasks/${encodeURIComponent(row.id)}` }, row.id)),
    el("td", {}, badge(row.state)),
    el("td", { class: "num" }, row.turn),
    el("td", { class: "num" }, tokens(row.usage)),
    el("td", { class: "num cost" }, cost(row)),
    el("td", { class: "num" }, row.tokens_used ?? "-"),
    el("td", { class: "num" }, row.restarts),
    el("td", {}, row.node || "-"),
    el("td", { class: "num" }, beat === null || beat === undefined ? "-" : `${beat.toFixed(1)}s`),
    el("td", {}, row.phase || "-"),
    el("td", { class: "reason" }, reason),
  ];
}

function renderRow(row) {
  const body = document.getElementById("tasks-body");
  if (!body) return;
  const tr = el("tr", { "data-task": row.id }, taskCells(row));
  const old = body.querySelector(`tr[data-task="${CSS.escape(row.id)}"]`);
  if (old) old.replaceWith(tr);
  else body.append(tr);
  document.getElementById("tasks-empty").hidden = state.rows.size > 0;
}

async function showTasks() {
  const answer = await api("GET", "/api/tasks");
  if (!answer.ok) return flash(answer.data.error, "error");
  for (const row of answer.data) state.rows.set(row.id, row);
  countHeld();
  const view = document.getElementById("view");
  view.replaceChildren(
    el("h1", {}, "Tasks"),
    el(
      "table",
      { class: "tasks" },
      el("thead", {}, el("tr", {}, COLUMNS.map((c) => el("th", {}, c)))),
      el("tbody", { id: "tasks-body" }),
    ),
    el("p", { id: "tasks-empty", class: "muted", hidden: state.rows.size > 0 },
      "No tasks yet: `agentd submit --prompt TEXT` adds one."),
  );
  for (const row of [...state.rows.values()].sort((a, b) => a.id.localeCompare(b.id))) renderRow(row);
}

// -- one task -------------------------------------------------------------------------

function facts(row) {
  const pairs = [
    ["turn", row.turn],
    ["tokens", `${row.usage?.input_tokens || 0} in / ${row.usage?.output_tokens || 0} out`],
    ["cost", cost(row)],
    ["context", row.tokens_used ?? "-"],
    ["compactions", row.compactions],
    ["restarts", row.restarts],
    ["node", row.node || "-"],
    ["phase", row.phase || "-"],
    ["workspace", row.workspace || "-"],
  ];
  if (row.forked_from) pairs.push(["forked from", `${row.forked_from.task} at turn ${row.forked_from.turn}`]);
  return el("dl", { class: "facts" }, pairs.map(([k, v]) => [el("dt", {}, k), el("dd", {}, String(v))]));
}

function actionsBar(id, row) {
  const base = `/api/tasks/${encodeURIComponent(id)}`;
  const rewindTo = el("input", { type: "number", min: 0, max: row.turn, value: Math.max(0, row.turn - 1), "aria-label": "rewind to turn" });
  const restore = el("input", { type: "checkbox", "aria-label": "restore the workspace" });
  const forkAt = el("input", { type: "number", min: 0, max: row.turn, value: row.turn, "aria-label": "fork at turn" });
  const forkName = el("input", { type: "text", placeholder: "name (optional)", "aria-label": "fork name" });
  const forkPrompt = el("input", { type: "text", placeholder: "extra message (optional)", "aria-label": "fork prompt" });
  const undo = el("div", { class: "undo", hidden: true });

  async function rewind(yes) {
    const body = { to: Number(rewindTo.value), yes, restore_workspace: restore.checked };
    const answer = await act(`${base}/rewind`, body, `${id}: rewound to turn ${body.to}`);
    undo.hidden = true;
    if (answer.status === 400 && answer.data.calls) {
      undo.replaceChildren(
        el("p", {}, "These calls have effects a rewind does not undo:"),
        el("ul", {}, answer.data.calls.map((c) => el("li", {}, `turn ${c.turn}: ${c.tool} (${c.effect}) ${c.call_id}`))),
        el("button", { class: "danger", onclick: () => rewind(true) }, "Rewind anyway"),
      );
      undo.hidden = false;
    }
  }

  return el(
    "section",
    { class: "actions" },
    el("button", {
      class: "danger",
      onclick: () => confirm(`Cancel ${id} for good? A cancelled task takes no decision, rewind or retry.`)
        && act(`${base}/cancel`, {}, `${id}: cancelled`),
    }, "Cancel"),
    el("button", { onclick: () => act(`${base}/retry`, {}, `${id}: queued for retry`) }, "Retry"),
    el("span", { class: "group" }, "Rewind to turn ", rewindTo, el("label", {}, restore, " restore files"),
      el("button", { onclick: () => rewind(false) }, "Rewind")),
    el("span", { class: "group" }, "Fork at turn ", forkAt, forkName, forkPrompt,
      el("button", {
        onclick: async () => {
          const answer = await act(`${base}/fork`, { at: Number(forkAt.value), name: forkName.value || null, prompt: forkPrompt.value || null }, "forked");
          if (answer.ok) location.hash = `#/tasks/${encodeURIComponent(answer.data.task.id)}`;
        },
      }, "Fork")),
    undo,
  );
}

function who(line) {
  return line.by ? ` (by ${line.by} via ${line.via})` : "";
}

function timeline(history) {
  const rows = history.map((r) => {
    if (r.kind === "compaction") {
      return el("tr", { class: "compaction" }, el("td", { class: "num" }, r.turn), el("td", {}, r.at || ""),
        el("td", { class: "num" }, `${r.tokens_before} → ${r.tokens_after}`),
        el("td", {}, `compacted turns ${r.first}–${r.last}: ${r.summary}`));
    }
    const calls = r.tool_calls.map((c) => el("span", { class: "call" }, `${c.tool} `,
      badge(c.is_error ? "error" : c.outcome, c.is_error ? "failed" : c.outcome),
      c.decision ? ` ${c.decision.action}${who(c.decision)}` : ""));
    const mark = r.rewound ? el("span", { class: "muted" }, ` rewound${r.rewind ? who(r.rewind) : ""}`) : "";
    return el("tr", { class: r.rewound ? "rewound" : "" }, el("td", { class: "num" }, r.turn), el("td", {}, r.at || ""),
      el("td", { class: "num" }, `${r.input_tokens}/${r.output_tokens}`),
      el("td", {}, calls.length ? calls : r.stop_reason || "", mark));
  });
  return el("table", { class: "timeline" },
    el("thead", {}, el("tr", {}, ["Turn", "Time", "Tokens in/out", "Tool calls"].map((c) => el("th", {}, c)))),
    el("tbody", {}, rows));
}

function message(line) {
  switch (line.kind) {
    case "text":
      return el("div", { class: `msg text ${line.role}` }, el("span", { class: "role" }, line.role), el("pre", {}, line.text));
    case "tool_use":
      return el("div", { class: "msg use" }, el("span", { class: "role" }, `→ ${line.tool}`), el("pre", {}, json(line.input)));
    case "tool_result": {
      const content = typeof line.content === "string" ? line.content : json(line.content);
      return el("div", { class: `msg result ${line.is_error ? "is-error" : ""}` },
        el("span", { class: "role" }, `← ${line.tool} `, badge(line.effect || "?", "effect"), " ", badge(line.outcome, line.outcome)),
        el("pre", {}, content));
    }
    case "compaction":
      return el("div", { class: "msg compaction" }, el("span", { class: "role" }, `compacted turns ${line.first}–${line.last} (${line.tokens_before} → ${line.tokens_after} tokens)`), el("pre", {}, line.summary));
    case "hold":
      return el("div", { class: "msg hold" }, line.calls.map((c) => el("p", {}, `held: ${c.tool} call ${c.call_id}: ${c.why}`)));
    case "decision":
      return el("div", { class: "msg decision" }, `decided: ${line.tool} call ${line.call_id} ${line.action}${who(line)}`,
        line.reason || line.result ? el("pre", {}, line.reason || line.result) : null);
    default:
      return el("pre", {}, json(line));
  }
}

function messages(lines) {
  const turns = [];
  for (const line of lines) {
    if (!turns.length || turns[turns.length - 1].turn !== line.turn) turns.push({ turn: line.turn, lines: [] });
    turns[turns.length - 1].lines.push(line);
  }
  return turns.map((t) => el("article", { class: "turn", id: `turn-${t.turn}` },
    el("h3", {}, t.turn === 0 ? "prompt" : `turn ${t.turn}`), t.lines.map(message)));
}

function events(list) {
  const skip = new Set(["event", "timestamp", "level", "task", "origin"]);
  return el("table", { class: "events" },
    el("tbody", {}, list.map((e) => el("tr", { class: e.level },
      el("td", {}, e.timestamp || ""), el("td", {}, e.event),
      el("td", { class: "fields" }, Object.entries(e).filter(([k]) => !skip.has(k)).map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`).join(" "))))));
}

// A task's page; ``again``: the same page brought up to date, its action bar (and what
// is typed in it) left as it is.
async function showTask(id, again) {
  const base = `/api/tasks/${encodeURIComponent(id)}`;
  const [detail, lines] = await Promise.all([api("GET", base), api("GET", `${base}/messages`)]);
  if (!detail.ok) return flash(detail.data.error, "error");
  const { task: row, history, events: list } = detail.data;
  state.rows.set(row.id, row);
  const parts = {
    "task-head": [el("h1", {}, row.id, " ", badge(row.state)), row.reason ? el("p", { class: "reason" }, row.reason) : null, facts(row)],
    "task-timeline": [el("h2", {}, "Timeline"), timeline(history)],
    "task-messages": [el("h2", {}, "Messages"),
      el("div", { class: "messages" }, lines.ok ? messages(lines.data) : el("p", { class: "muted" }, lines.data.error))],
    "task-events": [el("h2", {}, "Events"), events(list)],
  };
  if (again && document.getElementById("task-actions")) {
    for (const [key, children] of Object.entries(parts)) document.getElementById(key).replaceChildren(...children.filter(Boolean));
    return;
  }
  document.getElementById("view").replaceChildren(
    el("div", { id: "task-head" }, parts["task-head"]),
    el("div", { id: "task-actions" }, actionsBar(id, row)),
    el("div", { id: "task-timeline" }, parts["task-timeline"]),
    el("div", { id: "task-messages" }, parts["task-messages"]),
    el("div", { id: "task-events" }, parts["task-events"]),
  );
}

// -- the inbox ------------------------------------------------------------------------

// Each decision names the attempt of the call it was made on (a card left open while the
// call was held again is refused, 409, never applied to the new attempt); a re-run of an
// unsafe call whose outcome is unknown is confirmed first, its input shown (docs/guides/tools.md).
const SAFE_EFFECTS = ["read_only", "idempotent", "keyed"];

function heldCall(call) {
  const base = `/api/tasks/${encodeURIComponent(call.task)}/decisions`;
  const reason = el("input", { type: "text", placeholder: "why (the model is told)", "aria-label": "reason" });
  const result = el("textarea", { rows: 2, placeholder: "the verified result (what the model gets)", "aria-label": "result" });
  const decide = (action, extra, said) =>
    act(base, { call_id: call.call_id, attempt: call.attempt, action, ...extra }, `${call.task} ${call.call_id}: ${said}`);
  const before = call.stage === "before";
  const risky = !before && !SAFE_EFFECTS.includes(call.effect);
  const rerun = () => {
    if (risky && !confirm(`Re-run ${call.tool} call ${call.call_id} of ${call.task} (attempt ${call.attempt})? `
      + `Its outcome is unknown: it may have taken effect already, and running it again may repeat it.\n\n`
      + `Input:\n${json(call.input)}`)) return;
    decide("rerun", {}, before ? "approved" : "re-run");
  };
  const known = before ? "it has not run: it waits for approval" : `started ${call.started_at}: ${call.why || "its outcome is unknown"}`;
  return el("article", { class: "held", "data-call": call.call_id, "data-key": `${call.task}/${call.call_id}/${call.attempt}` },
    el("h3", {}, el("a", { href: `#/tasks/${encodeURIComponent(call.task)}` }, call.task), ` · ${call.tool} `, badge(call.effect, "effect")),
    el("p", { class: "muted" }, `call ${call.call_id}, attempt ${call.attempt}, ${known}`),
    el("pre", {}, json(call.input)),
    el("div", { class: "decide" },
      el("button", { onclick: rerun }, before ? "Run" : "Re-run"),
      el("span", { class: "group" }, reason, el("button", { onclick: () => decide("skip", { reason: reason.value || null }, "skipped") }, "Skip")),
      el("span", { class: "group" }, result, el("button", { onclick: () => decide("result", { result: result.value }, "result recorded") }, "Record result"))));
}

// The inbox; ``again``: brought up to date only when its calls changed (what is typed
// in a card stays while the card does).
async function showInbox(again) {
  const answer = await api("GET", "/api/held");
  if (!answer.ok) return flash(answer.data.error, "error");
  const { calls, tasks } = answer.data;
  const shown = [...document.querySelectorAll("article.held")].map((a) => a.dataset.key).join(" ");
  const now = [...calls.map((c) => `${c.task}/${c.call_id}/${c.attempt}`), ...tasks.map((t) => t.task)].join(" ");
  if (again && shown === now && document.querySelector("section.calls")) return;
  const view = document.getElementById("view");
  view.replaceChildren(
    el("h1", {}, "Inbox"),
    el("section", { class: "calls" },
      calls.length ? calls.map(heldCall) : el("p", { class: "muted" }, "No held calls: nothing waits for a decision.")),
    el("section", { class: "budgets" },
      tasks.length ? el("h2", {}, "Held on a budget") : null,
      tasks.map(heldTask)),
  );
}

// A task held on its budget: a new budget (USD, tokens: empty keeps a limit, "none"
// removes it) resumes it, as `agentd budget` does.
function heldTask(t) {
  const usd = el("input", { type: "text", placeholder: "USD (or none)", "aria-label": "usd", size: 10 });
  const tokens = el("input", { type: "text", placeholder: "tokens (or none)", "aria-label": "tokens", size: 12 });
  const limit = (input) => (input.value.trim() === "" ? undefined : input.value.trim());
  const raise = () => act(`/api/tasks/${encodeURIComponent(t.task)}/budget`,
    { usd: limit(usd), tokens: limit(tokens) }, `${t.task}: budget set`);
  return el("article", { class: "held budget", "data-key": t.task },
    el("h3", {}, el("a", { href: `#/tasks/${encodeURIComponent(t.task)}` }, t.task)),
    el("p", { class: "muted" }, t.reason),
    el("div", { class: "decide" }, usd, tokens, el("button", { onclick: raise }, "Set budget")));
}

// -- the page -------------------------------------------------------------------------

function route() {
  const hash = location.hash || "#/";
  const match = hash.match(/^#\/tasks\/(.+)$/);
  if (match) state.view = { name: "task", task: decodeURIComponent(match[1]) };
  else if (hash === "#/inbox") state.view = { name: "inbox" };
  else state.view = { name: "tasks" };
  const show = { tasks: showTasks, task: (again) => showTask(state.view.task, again), inbox: showInbox }[state.view.name];
  state.refresh = show;
  for (const link of document.querySelectorAll("nav a")) {
    link.classList.toggle("here", link.dataset.view === state.view.name);
  }
  flash("");
  show(false);
}

async function start() {
  const session = await api("GET", "/api/session");
  if (!session.ok) return;
  state.csrf = document.querySelector('meta[name="csrf-token"]').content || session.data.csrf || "";
  state.by = session.data.by;
  document.getElementById("who").textContent = state.by;
  window.addEventListener("hashchange", route);
  route();
  listen();
}

start();
