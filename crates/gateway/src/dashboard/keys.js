// The onedoor keys page: lists the runtime keys of GET /admin/keys, creates, disables, enables
// and rotates them, and shows a new secret once with a copy button. Every element is made with
// the DOM API, so names are always text, never markup.
'use strict';

(() => {
  const TOKEN_KEY = 'onedoor.admin.token';
  const REFRESH_MS = 5000;
  const $ = (id) => document.getElementById(id);
  let timer = null;

  function h(tag, props, ...children) {
    const el = document.createElement(tag);
    for (const [name, value] of Object.entries(props || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (name === 'class') el.className = value;
      else if (name === 'text') el.textContent = value;
      else el.setAttribute(name, value);
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      el.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return el;
  }

  function usd(n) {
    if (n === null || n === undefined) return '—';
    return '$' + n.toFixed(n < 1 ? 4 : 2);
  }

  function when(at) {
    if (!at) return h('span', { class: 'muted' }, '—');
    return h('span', { title: at }, at.replace('T', ' ').replace('Z', ' UTC'));
  }

  function limitsOf(limits) {
    const parts = Object.entries(limits || {}).map(([name, value]) => name + ' ' + value);
    return parts.length ? parts.join(', ') : h('span', { class: 'muted' }, "the tenant's");
  }

  // ---- talking to the admin API --------------------------------------------------------------

  class Refused extends Error {}

  async function call(method, path, body) {
    const token = sessionStorage.getItem(TOKEN_KEY);
    if (!token) throw new Refused('no token');
    const answer = await fetch(path, {
      method,
      headers: { Authorization: 'Bearer ' + token, 'Content-Type': 'application/json', 'x-onedoor-actor': 'keys page' },
      body: body === undefined ? undefined : JSON.stringify(body),
      cache: 'no-store',
    });
    const data = await answer.json().catch(() => ({}));
    if (answer.status === 401) {
      sessionStorage.removeItem(TOKEN_KEY);
      showLogin('The gateway refused that token. Enter its admin.token.');
      throw new Refused('unauthorized');
    }
    if (!answer.ok) throw new Refused((data.error && data.error.message) || 'HTTP ' + answer.status);
    return data;
  }

  function problem(text) {
    $('problem').hidden = !text;
    $('problem').textContent = text || '';
  }

  // ---- the secret, once --------------------------------------------------------------------

  function showSecret(title, key) {
    $('secret-title').textContent = title;
    $('secret-value').textContent = key.key;
    $('secret').dataset.keyId = key.id;
    $('secret').hidden = false;
    $('secret-copy').textContent = 'Copy';
  }

  async function copySecret() {
    const text = $('secret-value').textContent;
    try {
      await navigator.clipboard.writeText(text);
    } catch (error) {
      // Without clipboard access (a page not on localhost or HTTPS): select it for Ctrl-C.
      const range = document.createRange();
      range.selectNodeContents($('secret-value'));
      const selection = window.getSelection();
      selection.removeAllRanges();
      selection.addRange(range);
      document.execCommand('copy');
    }
    $('secret-copy').textContent = 'Copied';
  }

  // ---- the list ----------------------------------------------------------------------------

  function actions(key) {
    const toggle = h('button', { type: 'button', class: 'small', 'data-action': key.disabled ? 'enable' : 'disable' }, key.disabled ? 'Enable' : 'Disable');
    toggle.addEventListener('click', () => act(() => call('PATCH', '/admin/keys/' + key.id, { disabled: !key.disabled })));
    const rotate = h('button', { type: 'button', class: 'small', 'data-action': 'rotate' }, 'Rotate');
    rotate.addEventListener('click', () =>
      act(async () => {
        const rotated = await call('POST', '/admin/keys/' + key.id + '/rotate', { grace: $('grace').value });
        showSecret('New secret for ' + (key.name || key.id), rotated);
      }),
    );
    return h('td', { class: 'actions' }, toggle, rotate);
  }

  function row(key) {
    const budget = key.usd_budget === null ? '' : ' of ' + usd(key.usd_budget);
    return h(
      'tr',
      { 'data-key': key.id, 'data-state': key.state },
      h('td', null, h('div', null, key.name || h('span', { class: 'muted' }, 'unnamed')), h('code', null, key.id)),
      h('td', null, key.tenant),
      h('td', null, h('span', { class: 'pill ' + (key.state === 'active' ? 'closed' : 'open') }, key.state)),
      h('td', null, limitsOf(key.limits), key.models ? h('div', { class: 'muted small' }, 'models: ' + key.models.join(', ')) : null),
      h('td', null, usd(key.spend_usd) + budget),
      h('td', null, when(key.expires_at)),
      h('td', null, when(key.last_used_at)),
      actions(key),
    );
  }

  function render(list) {
    const body = $('keys').tBodies[0];
    if (list.keys.length === 0) {
      body.replaceChildren(h('tr', null, h('td', { class: 'empty', colspan: 8 }, 'No runtime keys yet: create one above.')));
    } else {
      body.replaceChildren(...list.keys.map(row));
    }
    const active = list.keys.filter((k) => k.state === 'active').length;
    $('keys-note').textContent = list.keys.length + ' keys, ' + active + ' active';
    document.body.dataset.renders = String(Number(document.body.dataset.renders || 0) + 1);
  }

  async function tenants() {
    const data = await call('GET', '/admin/tenants');
    const select = $('create-tenant');
    const chosen = select.value;
    select.replaceChildren(...data.tenants.map((t) => h('option', { value: t.name }, t.name)));
    if (chosen) select.value = chosen;
  }

  // ---- actions -----------------------------------------------------------------------------

  async function act(work) {
    problem('');
    try {
      await work();
    } catch (error) {
      if (!(error instanceof Refused)) console.error(error);
      problem(error.message);
    }
    await refresh();
  }

  function created() {
    const number = (id) => ($(id).value === '' ? undefined : Number($(id).value));
    const text = (id) => $(id).value.trim() || undefined;
    const body = { tenant: $('create-tenant').value, name: text('create-name') };
    const models = text('create-models');
    if (models) body.models = models.split(',').map((m) => m.trim()).filter(Boolean);
    const limits = { rpm: number('create-rpm'), tpm: number('create-tpm') };
    if (limits.rpm !== undefined || limits.tpm !== undefined) body.limits = limits;
    const budget = number('create-budget');
    if (budget !== undefined) Object.assign(body, { usd_budget: budget, budget_period: 'month' });
    body.expires_at = text('create-expires');
    return body;
  }

  async function create(event) {
    event.preventDefault();
    await act(async () => {
      const key = await call('POST', '/admin/keys', created());
      showSecret('New key ' + (key.name || key.id), key);
      $('create').reset();
    });
  }

  // ---- the loop ----------------------------------------------------------------------------

  function setStatus(state, text) {
    $('status').dataset.state = state;
    $('status-text').textContent = text;
  }

  function showLogin(note) {
    clearTimeout(timer);
    $('login').hidden = false;
    $('content').hidden = true;
    setStatus('idle', 'no token');
    if (note) $('login-note').textContent = note;
    $('token').focus();
  }

  async function refresh() {
    clearTimeout(timer);
    if (!sessionStorage.getItem(TOKEN_KEY)) return showLogin();
    try {
      if ($('create-tenant').options.length === 0) await tenants();
      render(await call('GET', '/admin/keys'));
      $('content').hidden = false;
      $('login').hidden = true;
      setStatus('live', 'live');
    } catch (error) {
      if (error.message === 'unauthorized') return;
      setStatus('down', error instanceof Refused ? error.message : 'unreachable');
    }
    timer = setTimeout(refresh, REFRESH_MS);
  }

  function tokenFromFragment() {
    const fragment = new URLSearchParams(location.hash.slice(1));
    const token = fragment.get('token');
    if (token) {
      sessionStorage.setItem(TOKEN_KEY, token);
      history.replaceState(null, '', location.pathname + location.search);
    }
  }

  document.addEventListener('DOMContentLoaded', () => {
    tokenFromFragment();
    $('login-form').addEventListener('submit', (event) => {
      event.preventDefault();
      const token = $('token').value.trim();
      if (!token) return;
      sessionStorage.setItem(TOKEN_KEY, token);
      $('token').value = '';
      refresh();
    });
    $('create').addEventListener('submit', create);
    $('secret-copy').addEventListener('click', copySecret);
    $('secret-hide').addEventListener('click', () => {
      $('secret').hidden = true;
      $('secret-value').textContent = '';
    });
    refresh();
  });
})();
