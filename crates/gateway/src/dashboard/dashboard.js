// The onedoor dashboard: polls GET /admin/dashboard with the admin token and draws what it gets.
// No framework, no build step; every element is made with the DOM API, so names from the config
// are always text, never markup.
'use strict';

(() => {
  const TOKEN_KEY = 'onedoor.admin.token';
  const REFRESH_MS = 2000;
  const MINUTE = 60e3;
  const HOUR = 60 * MINUTE;
  const SVG = 'http://www.w3.org/2000/svg';
  const SHORTEST_MS = 3000;

  const $ = (id) => document.getElementById(id);
  let timer = null;
  let lastOk = 0;

  // ---- elements ----------------------------------------------------------------------------

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

  function s(tag, attrs) {
    const el = document.createElementNS(SVG, tag);
    for (const [name, value] of Object.entries(attrs || {})) el.setAttribute(name, value);
    return el;
  }

  function rows(table, list, empty, columns) {
    const body = $(table).tBodies[0];
    if (list.length === 0) {
      body.replaceChildren(h('tr', null, h('td', { class: 'empty', colspan: columns }, empty)));
    } else {
      body.replaceChildren(...list);
    }
  }

  // ---- numbers -----------------------------------------------------------------------------

  // `n` with one decimal below ten units and none above, without a trailing `.0`.
  function scaled(n, unit, suffix) {
    return (n / unit).toFixed(Math.abs(n) >= 10 * unit ? 0 : 1).replace(/\.0$/, '') + suffix;
  }

  function count(n) {
    if (n === null || n === undefined) return '—';
    const abs = Math.abs(n);
    if (abs >= 1e9) return scaled(n, 1e9, 'G');
    if (abs >= 1e6) return scaled(n, 1e6, 'M');
    if (abs >= 1e4) return scaled(n, 1e3, 'k');
    if (abs >= 10 || Number.isInteger(n)) return Math.round(n).toLocaleString('en-US');
    return n.toFixed(abs >= 1 ? 1 : 2);
  }

  function rate(n) {
    if (n === 0) return '0';
    if (n < 0.01) return '<0.01';
    return count(n);
  }

  function usd(n) {
    if (n === null || n === undefined) return '—';
    if (n === 0) return '$0';
    if (n < 0.01) return '$' + n.toFixed(4);
    if (n < 1) return '$' + n.toFixed(3).replace(/0$/, '');
    if (n < 100) return '$' + n.toFixed(2);
    return '$' + Math.round(n).toLocaleString('en-US');
  }

  function duration(ms) {
    if (ms === null || ms === undefined) return '';
    const sec = Math.max(0, Math.ceil(ms / 1000));
    if (sec < 90) return sec + 's';
    const min = Math.round(sec / 60);
    if (min < 90) return min + 'm';
    const hours = Math.floor(min / 60);
    if (hours < 48) return hours + 'h ' + (min % 60) + 'm';
    return Math.floor(hours / 24) + 'd';
  }

  function latency(ms) {
    if (!ms) return '—';
    if (ms < 10) return ms.toFixed(1) + ' ms';
    if (ms < 1000) return Math.round(ms) + ' ms';
    return (ms / 1000).toFixed(2) + ' s';
  }

  function clock(at) {
    return new Date(at).toLocaleTimeString('en-GB', { hour12: false });
  }

  // ---- history -----------------------------------------------------------------------------

  // The latest point at least `ago` ms before `last`, else the first one.
  function pointBefore(points, last, ago) {
    let found = points[0];
    for (const p of points) {
      if (p.at_ms <= last.at_ms - ago) found = p;
      else break;
    }
    return found;
  }

  function errorsOf(p) {
    return p.client_errors + p.server_errors;
  }

  function tokensOf(p) {
    return p.input_tokens + p.output_tokens;
  }

  // The rate of `value` per `per` ms in each interval between two points: [start, end, rate].
  // The interval up to now is left out while it is too short to say much.
  function rates(points, value, per) {
    const out = [];
    for (let i = 1; i < points.length; i++) {
      const dt = points[i].at_ms - points[i - 1].at_ms;
      if (dt <= 0 || (i === points.length - 1 && i > 1 && dt < SHORTEST_MS)) continue;
      const dv = Math.max(0, value(points[i]) - value(points[i - 1]));
      out.push([points[i - 1].at_ms, points[i].at_ms, (dv * per) / dt]);
    }
    return out;
  }

  // What `value` grew by since the first point, as a line through every point.
  function cumulative(points, value) {
    if (points.length < 2) return [];
    const base = value(points[0]);
    const out = [];
    for (let i = 1; i < points.length; i++) {
      out.push([points[i - 1].at_ms, points[i].at_ms, Math.max(0, value(points[i - 1]) - base), Math.max(0, value(points[i]) - base)]);
    }
    return out;
  }

  // ---- charts ------------------------------------------------------------------------------

  // The top of the axis: four gridline steps of 1, 2, 2.5 or 5 times a power of ten.
  function niceMax(v) {
    if (!(v > 0)) return 1;
    const quarter = v / 4;
    const power = Math.pow(10, Math.floor(Math.log10(quarter)));
    for (const step of [1, 2, 2.5, 5, 10]) {
      if (quarter <= step * power) return 4 * step * power;
    }
    return 40 * power;
  }

  function minuteStep(span) {
    for (const step of [1, 2, 5, 10, 15, 20, 30]) {
      if (span / (step * MINUTE) <= 5) return step * MINUTE;
    }
    return 30 * MINUTE;
  }

  // Draws `series` into the figure `id` over [from, to]. Each series' `points` are intervals:
  // [start, end, value] drawn as steps (a rate over the interval), or [start, end, v0, v1] drawn
  // as a line (a total growing over it).
  function chart(id, from, to, series, format) {
    const figure = $(id);
    const svg = figure.querySelector('svg');
    const width = Math.max(200, Math.round(svg.getBoundingClientRect().width) || 400);
    const height = 150;
    const left = 46;
    const right = 10;
    const top = 8;
    const bottom = 22;
    const plotW = width - left - right;
    const plotH = height - top - bottom;
    svg.setAttribute('viewBox', `0 0 ${width} ${height}`);
    const max = niceMax(Math.max(0, ...series.flatMap((one) => one.points.map((p) => p[p.length - 1]))));
    const x = (t) => left + ((t - from) / (to - from)) * plotW;
    const y = (v) => top + plotH - (v / max) * plotH;
    const parts = [];
    for (let i = 0; i <= 4; i++) {
      const v = (max * i) / 4;
      const gy = y(v);
      parts.push(s('line', { class: 'grid', x1: left, x2: width - right, y1: gy, y2: gy }));
      const label = s('text', { class: 'axis', x: left - 6, y: gy + 4, 'text-anchor': 'end' });
      label.textContent = format(v);
      parts.push(label);
    }
    const step = minuteStep(to - from);
    for (let ago = 0; ago <= to - from + 1; ago += step) {
      const label = s('text', { class: 'axis', x: x(to - ago), y: height - 5, 'text-anchor': ago === 0 ? 'end' : 'middle' });
      label.textContent = ago === 0 ? 'now' : `−${Math.round(ago / MINUTE)}m`;
      parts.push(label);
    }
    const drawn = series.filter((one) => one.points.length > 0);
    for (const one of drawn) {
      const pts = [];
      for (const p of one.points) {
        if (p[1] < from) continue;
        const start = x(Math.max(from, p[0]));
        const end = x(p[1]);
        if (p.length === 3) pts.push([start, y(p[2])], [end, y(p[2])]);
        else pts.push([start, y(p[2])], [end, y(p[3])]);
      }
      if (pts.length === 0) continue;
      const line = pts.map((p, i) => (i === 0 ? 'M' : 'L') + p[0].toFixed(1) + ',' + p[1].toFixed(1)).join('');
      const base = y(0).toFixed(1);
      const area = line + `L${pts[pts.length - 1][0].toFixed(1)},${base}L${pts[0][0].toFixed(1)},${base}Z`;
      parts.push(s('path', { class: 'area ' + one.cls, d: area }));
      parts.push(s('path', { class: 'line ' + one.cls, d: line }));
    }
    if (drawn.length === 0) {
      const note = s('text', { class: 'empty', x: left + plotW / 2, y: top + plotH / 2, 'text-anchor': 'middle' });
      note.textContent = 'collecting: a sample every 10 s';
      parts.push(note);
    }
    const guide = s('line', { class: 'guide', y1: top, y2: top + plotH, visibility: 'hidden' });
    parts.push(guide);
    svg.replaceChildren(...parts);
    figure.plot = drawn.length ? { from, to, left, plotW, series, format, guide } : null;
    hover(figure);
    const legend = figure.querySelector('.legend');
    legend.replaceChildren(
      ...series.map((one) => {
        const last = one.points.length ? one.points[one.points.length - 1].at(-1) : null;
        return h('span', null, h('span', { class: 'swatch ' + one.cls }), one.label + ' ', h('b', null, last === null ? '—' : format(last)));
      }),
    );
  }

  // The values under the pointer: a guide line and a tip with the interval's time and values.
  function hover(figure) {
    const plot = figure.plot;
    const tip = figure.querySelector('.tip');
    const x = figure.pointerX;
    if (!plot || x === undefined || x < plot.left || x > plot.left + plot.plotW) {
      if (plot) plot.guide.setAttribute('visibility', 'hidden');
      tip.hidden = true;
      return;
    }
    const at = plot.from + ((x - plot.left) / plot.plotW) * (plot.to - plot.from);
    const values = plot.series.map((one) => {
      const p = one.points.find((q) => q[0] <= at && at <= q[1]);
      return p ? [one, p.length === 3 ? p[2] : p[2] + ((p[3] - p[2]) * (at - p[0])) / (p[1] - p[0])] : null;
    });
    if (values.every((v) => v === null)) {
      plot.guide.setAttribute('visibility', 'hidden');
      tip.hidden = true;
      return;
    }
    plot.guide.setAttribute('x1', x);
    plot.guide.setAttribute('x2', x);
    plot.guide.setAttribute('visibility', 'visible');
    tip.replaceChildren(
      h('div', { class: 'muted' }, clock(at)),
      ...values.filter(Boolean).map(([one, v]) => h('div', null, h('span', { class: 'swatch ' + one.cls }), one.label + ' ', h('b', null, plot.format(v)))),
    );
    tip.hidden = false;
    // Right of the pointer, or left of it near the right edge.
    const pointer = figure.querySelector('svg').offsetLeft + x;
    const right = pointer + 12 + tip.offsetWidth <= figure.clientWidth;
    tip.style.left = (right ? pointer + 12 : Math.max(0, pointer - 12 - tip.offsetWidth)) + 'px';
  }

  function watchPointer(figure) {
    const svg = figure.querySelector('svg');
    figure.append(h('div', { class: 'tip', hidden: 'hidden' }));
    svg.addEventListener('mousemove', (event) => {
      const box = svg.getBoundingClientRect();
      const scale = box.width ? svg.viewBox.baseVal.width / box.width : 1;
      figure.pointerX = (event.clientX - box.left) * scale;
      hover(figure);
    });
    svg.addEventListener('mouseleave', () => {
      delete figure.pointerX;
      hover(figure);
    });
  }

  function charts(history, now) {
    const points = history.points;
    const first = points.length ? points[0].at_ms : now;
    const span = Math.min(HOUR, Math.max(5 * MINUTE, now - first));
    const from = now - span;
    chart('chart-requests', from, now, [{ label: 'all', cls: 's1', points: rates(points, (p) => p.requests, 1000) }], rate);
    chart(
      'chart-errors',
      from,
      now,
      [
        { label: '4xx', cls: 's4xx', points: rates(points, (p) => p.client_errors, 1000) },
        { label: '5xx', cls: 's5xx', points: rates(points, (p) => p.server_errors, 1000) },
      ],
      rate,
    );
    chart(
      'chart-tokens',
      from,
      now,
      [
        { label: 'input', cls: 's1', points: rates(points, (p) => p.input_tokens, MINUTE) },
        { label: 'output', cls: 's2', points: rates(points, (p) => p.output_tokens, MINUTE) },
      ],
      count,
    );
    chart('chart-cost', from, now, [{ label: 'spent', cls: 's1', points: cumulative(points, (p) => p.cost_usd) }], usd);
  }

  // ---- tiles -------------------------------------------------------------------------------

  function tile(label, value, hint, tone) {
    return h('div', { class: 'tile' + (tone ? ' ' + tone : '') }, h('div', { class: 'label' }, label), h('div', { class: 'value' }, value), h('div', { class: 'hint' }, hint));
  }

  function tiles(data) {
    const points = data.history.points;
    const last = points[points.length - 1];
    const minute = pointBefore(points, last, MINUTE);
    const five = pointBefore(points, last, 5 * MINUTE);
    const hour = points[0];
    const seconds = Math.max(1, (last.at_ms - minute.at_ms) / 1000);
    const requests = (last.requests - minute.requests) / seconds;
    const answered = last.requests - five.requests;
    const failed = errorsOf(last) - errorsOf(five);
    const share = answered > 0 ? (100 * failed) / answered : 0;
    const open = data.backends.reduce((sum, b) => sum + tripped(b.breaker).length + (b.breaker.state !== 'closed' ? 1 : 0), 0);
    const out = data.backends.filter((b) => b.drained || !b.healthy).length;
    const inFlight = data.backends.reduce((sum, b) => sum + ((b.load && b.load.this_instance.in_flight) || 0), 0);
    const window = duration(last.at_ms - hour.at_ms) || '0s';
    $('tiles').replaceChildren(
      tile('Requests / s', rate(requests), 'last minute'),
      tile('Errors', share.toFixed(share > 0 && share < 10 ? 1 : 0) + '%', count(failed) + ' of ' + count(answered) + ', last 5 min', share >= 5 ? 'bad' : share > 0 ? 'warn' : null),
      tile('In flight', count(inFlight), 'on this instance'),
      tile('Tokens', count(tokensOf(last) - tokensOf(hour)), 'last ' + window),
      tile('Spend', usd(last.cost_usd - hour.cost_usd), 'last ' + window),
      tile('Backends', data.backends.length - open - out + ' / ' + data.backends.length, open + ' breaker' + (open === 1 ? '' : 's') + ' not closed' + (out ? ', ' + out + ' out of rotation' : ''), open ? 'bad' : out ? 'warn' : null),
    );
  }

  // ---- tables ------------------------------------------------------------------------------

  // used against limit as a bar; a plain number when there is no limit.
  function bar(used, limit, format) {
    if (limit === null || limit === undefined) {
      return h('span', null, format(used || 0), ' ', h('span', { class: 'muted small' }, 'no limit'));
    }
    const share = limit > 0 ? Math.min(1, (used || 0) / limit) : 1;
    const tone = share >= 0.9 ? ' hot' : share >= 0.7 ? ' warn' : '';
    const fill = h('div', { class: 'fill' });
    fill.style.width = (share * 100).toFixed(1) + '%';
    return h('div', { class: 'bar' + tone, title: Math.round(share * 100) + '% used' }, fill, h('div', { class: 'text' }, format(used || 0) + ' / ' + format(limit)));
  }

  // The targets of a backend whose own breakers are not closed.
  function tripped(breaker) {
    return (breaker.targets || []).filter((t) => t.state !== 'closed');
  }

  // One breaker's pill, with its next probe and trips.
  function breakerLine(breaker, name) {
    const state = breaker.state;
    const label = state === 'half_open' ? 'half-open' : state;
    const extra = [];
    if (state === 'open' && breaker.next_probe_in_ms !== null) extra.push('probe in ' + duration(breaker.next_probe_in_ms));
    if (state === 'half_open') extra.push('probing');
    if (breaker.trips > 0) extra.push(breaker.trips + ' trip' + (breaker.trips === 1 ? '' : 's'));
    return h(
      'div',
      { 'data-breaker': state, 'data-deployment': name || null },
      name ? h('span', { class: 'small' }, name + ' ') : null,
      h('span', { class: 'pill ' + state }, label),
      extra.length ? h('span', { class: 'muted small' }, ' ' + extra.join(' · ')) : null,
    );
  }

  // The backend's own breaker (connection failures), then each target's that is not closed.
  function breakerCell(breaker) {
    return h(
      'td',
      { class: 'breaker', 'data-breaker': breaker.state, title: breaker.policy ? 'policy ' + breaker.policy : 'no circuit_breaker' },
      breakerLine(breaker, null),
      tripped(breaker).map((t) => breakerLine(t, t.deployment)),
    );
  }

  function rotationCell(b) {
    const pills = [];
    if (b.drained) pills.push(h('span', { class: 'pill drained' }, 'drained'));
    if (!b.healthy) pills.push(h('span', { class: 'pill unhealthy' }, 'unhealthy'));
    if (pills.length === 0) pills.push(h('span', { class: 'muted' }, 'in rotation'));
    return h('td', null, pills);
  }

  function backends(list) {
    rows(
      'backends',
      list.map((b) => {
        const load = b.load || { window: {}, this_instance: {} };
        const window = load.window || {};
        const notServed = b.not_served.length;
        const cooling = b.cooling_down.length;
        return h(
          'tr',
          { 'data-backend': b.name, class: b.breaker.state === 'open' ? 'alert' : b.breaker.state === 'half_open' || tripped(b.breaker).length ? 'caution' : null },
          h('td', null, h('div', { class: 'strong' }, b.name), h('div', { class: 'muted small' }, b.provider + ' · ' + b.region)),
          breakerCell(b.breaker),
          rotationCell(b),
          h('td', { class: 'num' }, count(load.in_flight || 0), load.max_in_flight ? h('span', { class: 'muted' }, ' / ' + count(load.max_in_flight)) : null),
          h('td', null, bar(window.requests, window.rpm_limit, count)),
          h('td', null, bar(window.tokens, window.tpm_limit, count)),
          h('td', { class: 'num' }, latency(load.latency_ewma_ms)),
          h(
            'td',
            { class: 'num', title: b.not_served.map((e) => e.deployment).join(', ') },
            notServed ? count(notServed) : h('span', { class: 'muted' }, '0'),
            cooling ? h('div', { class: 'muted small' }, cooling + ' cooling down') : null,
          ),
        );
      }),
      'No backends configured.',
      8,
    );
    const shared = list.some((b) => b.load && b.load.counted === 'shared');
    $('backends-note').textContent = shared ? 'windows: rolling minute, counted across instances' : 'windows: rolling minute, this instance';
  }

  function limitCell(limit, format) {
    if (!limit) return h('td', { class: 'muted' }, '—');
    const cell = h('td', null, bar(limit.used, limit.limit, format));
    if (limit.resets_in_ms) cell.title = 'resets in ' + duration(limit.resets_in_ms);
    return cell;
  }

  function limitRow(name, limits, cls) {
    return h(
      'tr',
      { class: cls, 'data-tenant': name },
      h('td', { class: cls ? null : 'strong' }, name),
      limitCell(limits.rpm, count),
      limitCell(limits.tpm, count),
      limitCell(limits.max_in_flight, count),
      limitCell(limits.tokens_per_day, count),
      limitCell(limits.usd_per_month, usd),
    );
  }

  function tenants(list, store) {
    const out = [];
    for (const t of list) {
      out.push(limitRow(t.name, t.limits || {}, null));
      for (const key of t.keys || []) out.push(limitRow('key ' + key.id, key.limits || {}, 'key'));
    }
    rows('tenants', out, 'No tenants configured.', 6);
    const where = store ? store.store + (store.readable ? '' : ', unreadable now') : '';
    $('tenants-note').textContent = 'counted in the ' + where + ' state store; — means no such limit';
  }

  function codes(errors, now) {
    const max = Math.max(1, ...errors.by_code.map((c) => c.count));
    rows(
      'codes',
      errors.by_code.map((c) => {
        const fill = h('div', { class: 'fill' });
        fill.style.width = ((100 * c.count) / max).toFixed(1) + '%';
        return h(
          'tr',
          { 'data-code': c.code },
          h('td', null, c.code === '-' ? h('span', { class: 'muted' }, 'upstream answer') : h('code', null, c.code)),
          h('td', { class: 'num' }, c.status || '—'),
          h('td', null, h('div', { class: 'bar count' }, fill, h('div', { class: 'text' }, count(c.count)))),
        );
      }),
      'No errors.',
      3,
    );
    $('codes-note').textContent = 'last ' + (duration(now - errors.since_ms) || '0s');
  }

  // `a=connect_error,b=502` as `a connect_error · b 502`; a dash when nothing was tried.
  function attemptsOf(attempts) {
    if (!attempts) return h('span', { class: 'muted' }, '—');
    const tried = attempts.split(',').map((one) => one.replace('=', ' '));
    const more = tried.length > 2 ? ' +' + (tried.length - 2) : '';
    return h('span', { class: 'muted small' }, 'tried ' + tried.slice(0, 2).join(', ') + more);
  }

  function recent(errors) {
    rows(
      'errors',
      errors.recent.map((e) =>
        h(
          'tr',
          null,
          h('td', { class: 'muted' }, clock(e.at_ms)),
          h('td', { class: 'num' }, h('span', { class: 'pill ' + (e.status >= 500 ? 'open' : 'half_open') }, e.status)),
          h('td', null, e.code === '-' ? h('span', { class: 'muted' }, 'upstream answer') : h('code', null, e.code)),
          h('td', null, e.tenant || h('span', { class: 'muted' }, '—')),
          h('td', null, e.alias || h('span', { class: 'muted' }, '—')),
          h('td', { class: 'wrap', title: e.attempts || 'no upstream attempt' }, e.backend || attemptsOf(e.attempts)),
        ),
      ),
      'No errors since the gateway started.',
      6,
    );
    $('errors-note').textContent = errors.recent.length ? 'the last ' + errors.recent.length + ', newest first' : '';
  }

  function batches(list) {
    rows(
      'batches',
      (list || []).map((b) => {
        const counts = b.request_counts || {};
        const done = counts.total ? (counts.completed || 0) + ' / ' + counts.total : '—';
        return h(
          'tr',
          null,
          h('td', null, h('code', null, b.id)),
          h('td', null, b.tenant),
          h('td', null, b.alias),
          h('td', null, b.backend),
          h('td', null, h('span', { class: 'pill half_open' }, b.status || 'validating')),
          h('td', { class: 'num' }, done),
          h('td', { class: 'num' }, count(b.estimated_tokens)),
          h('td', { class: 'muted' }, clock(b.created_at * 1000)),
        );
      }),
      'No open batches.',
      8,
    );
    $('batches-note').textContent = list && list.length ? list.length + ' open, oldest first' : '';
  }

  // ---- the loop ----------------------------------------------------------------------------

  let renders = 0;

  function render(data) {
    $('content').hidden = false;
    $('login').hidden = true;
    const started = data.history.started_ms;
    $('meta').replaceChildren(
      h('span', null, 'v' + data.version),
      started ? h('span', null, 'history from ' + clock(started)) : null,
      h('span', null, data.backends.length + ' backends'),
      h('span', null, data.tenants.length + ' tenants'),
    );
    tiles(data);
    charts(data.history, data.now_ms);
    backends(data.backends);
    tenants(data.tenants, data.state_store);
    batches(data.open_batches);
    codes(data.errors, data.now_ms);
    recent(data.errors);
    document.body.dataset.renders = String(++renders);
  }

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

  // One poll at a time: a refresh asked for while one is under way is that one.
  let polling = false;

  async function refresh() {
    if (polling) return;
    polling = true;
    clearTimeout(timer);
    let again = true;
    try {
      again = await poll();
    } catch (error) {
      // A fault of the page itself: in the console, and the next poll tries again.
      console.error(error);
      setStatus('down', 'page error, see the console');
    } finally {
      polling = false;
    }
    if (again) timer = setTimeout(refresh, REFRESH_MS);
  }

  // Fetches and draws once; false when there is no token to poll with.
  async function poll() {
    const token = sessionStorage.getItem(TOKEN_KEY);
    if (!token) {
      showLogin();
      return false;
    }
    let data;
    try {
      const answer = await fetch('/admin/dashboard', {
        headers: { Authorization: 'Bearer ' + token },
        cache: 'no-store',
      });
      if (answer.status === 401) {
        sessionStorage.removeItem(TOKEN_KEY);
        showLogin('The gateway refused that token. Enter its admin.token.');
        return false;
      }
      if (!answer.ok) throw new Error('HTTP ' + answer.status);
      data = await answer.json();
    } catch (error) {
      const age = lastOk ? ', showing ' + duration(Date.now() - lastOk) + ' old data' : '';
      setStatus('down', 'unreachable' + age);
      return true;
    }
    render(data);
    lastOk = Date.now();
    setStatus('live', 'live');
    return true;
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
    document.querySelectorAll('figure.chart').forEach(watchPointer);
    $('login-form').addEventListener('submit', (event) => {
      event.preventDefault();
      const token = $('token').value.trim();
      if (!token) return;
      sessionStorage.setItem(TOKEN_KEY, token);
      $('token').value = '';
      refresh();
    });
    window.addEventListener('hashchange', () => {
      tokenFromFragment();
      refresh();
    });
    document.addEventListener('visibilitychange', () => {
      if (!document.hidden) refresh();
    });
    refresh();
  });
})();
