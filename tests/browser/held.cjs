// Reads what a finished run left on its held dashboard (`dsh workflow|ralph
// … --dashboard --hold`) in headless Chromium, and saves a screenshot.
// Usage: node held.cjs <url-with-token> <children> <png-path>
// Waits for <children> stopped children in the tree, opens the run's
// coordinator (the row labelled «… coordinator») and reads its
// conversation. Prints one JSON line with what it saw.
"use strict";
const { WAIT, run } = require("./browser.cjs");

const [url, count, png] = process.argv.slice(2);

function step(name) { process.stderr.write(`held: ${name}\n`); }

run(async (browser) => {
  const page = await browser.newPage({ viewport: { width: 1500, height: 900 } });
  await page.goto(url);
  await page.waitForSelector(`#state:text("live")`, { timeout: WAIT });

  step(`waiting for ${count} stopped children`);
  const children = '[data-name^="scope/subagent/"][data-stopped]';
  await page.waitForFunction(
    ([sel, n]) => document.querySelectorAll(sel).length >= n, [children, +count], { timeout: WAIT });
  const rows = await page.$$eval(children, (rs) => rs.map((r) => ({
    label: (r.querySelector(".label") || {}).textContent || null,
    status: r.dataset.status,
    took: (r.querySelector(".took") || {}).textContent || null,
    text: r.textContent,
  })));
  const groups = await page.$$eval("#tree .group", (gs) => gs.map((g) => g.textContent));

  step("the coordinator's conversation");
  const coordinator = page.locator(".row", { has: page.locator(".label", { hasText: "coordinator" }) }).first();
  const coordinatorRow = await coordinator.textContent();
  await coordinator.click();
  await page.waitForSelector("#conversation", { timeout: WAIT });
  await page.waitForFunction(() =>
    document.querySelectorAll("#conversation .msg.child[data-outcome], #conversation .msg.handoff").length > 0,
  null, { timeout: WAIT });
  // Every child's line is complete (its end read) before it is read.
  await page.waitForFunction(() =>
    [...document.querySelectorAll("#conversation .msg.child")].every((m) => m.dataset.outcome),
  null, { timeout: WAIT });
  const detail = await page.$eval("#agent-id", (a) => a.parentElement.textContent);
  step("the coordinator's timeline");
  await page.waitForSelector("#timeline .chart-box", { timeout: WAIT });
  const lanes = await page.$$eval("#timeline .lane[data-agent]", (ls) => ls.map((l) => ({
    agent: l.dataset.agent, name: l.querySelector(".lane-name").textContent,
    bars: [...l.querySelectorAll(".bar")].map((b) => `${b.dataset.kind}:${b.dataset.status}`),
    tokens: +l.querySelector(".lane-tokens").textContent,
  })));
  const bands = await page.$$eval("#timeline .band", (bs) => bs.map((b) => b.textContent));
  const spent = await page.locator("#timeline-tokens").textContent();
  const chartCalls = await page.$eval("#timeline .chart-box", (c) => +c.dataset.calls);
  const phases = await page.$$eval("#conversation .group", (gs) => gs.map((g) => g.textContent));
  const lines = await page.$$eval("#conversation .msg.child", (ms) => ms.map((m) => ({
    label: (m.querySelector(".label") || {}).textContent || null,
    outcome: m.dataset.outcome, text: m.textContent,
    link: !!m.querySelector("a.session-link"),
  })));
  const handoffs = await page.$$eval("#conversation .msg.handoff", (ms) => ms.map((m) => ({
    round: +m.dataset.round, class: m.className, text: m.textContent,
    link: !!m.querySelector("a.session-link"),
  })));
  const notes = await page.$$eval("#conversation .msg.note:not(.child)", (ms) => ms.map((m) => m.textContent));
  await page.screenshot({ path: png, fullPage: true });

  step("a stopped child's final state");
  await page.locator(children).first().click();
  await page.waitForFunction(() => /ran \d/.test(document.getElementById("detail").textContent), null, { timeout: WAIT });
  await page.waitForSelector("#detail #conversation .msg.user", { timeout: WAIT });
  const final = await page.locator("#detail").textContent();
  console.log(JSON.stringify({ rows, groups, coordinatorRow, detail, phases, lines, handoffs, notes, final, lanes, bands, spent, chartCalls }));
});
