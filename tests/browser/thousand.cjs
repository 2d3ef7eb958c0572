// A tree of a thousand agents in headless Chromium: the DOM holds only the
// rows in view and an overscan, however far one scrolls; the search brings
// a match into view; sorting by tokens puts the spenders first.
// Usage: node thousand.cjs <url-with-token> <rows-at-least> <last-name> <sought-name> <png-path>
// Prints one JSON line with what it saw.
"use strict";
const { WAIT, run } = require("./browser.cjs");

const [url, least, lastName, sought, png] = process.argv.slice(2);

function step(name) { process.stderr.write(`thousand: ${name}\n`); }
// What the tree holds now: rows in the list, rows in the DOM, the view.
const look = () => ({
  rows: +document.getElementById("tree").dataset.rows,
  dom: document.querySelectorAll("#tree > div").length,
  view: document.getElementById("left").clientHeight,
  renderMs: +document.getElementById("tree").dataset.renderMs,
});

run(async (browser) => {
  const page = await browser.newPage({ viewport: { width: 1400, height: 800 } });
  await page.goto(url);
  await page.waitForSelector(`#state:text("live")`, { timeout: WAIT });
  step(`waiting for ${least} rows`);
  await page.waitForFunction((n) => +document.getElementById("tree").dataset.rows >= n, +least, { timeout: WAIT });
  const top = await page.evaluate(look);
  step("scrolled to the end");
  await page.evaluate(() => { const v = document.getElementById("left"); v.scrollTop = v.scrollHeight; });
  await page.waitForSelector(`[data-name="${lastName}"]`, { timeout: WAIT });
  const bottom = await page.evaluate(look);
  await page.screenshot({ path: png });
  step("the search");
  await page.fill("#search", sought.toLowerCase());
  await page.waitForSelector(`.row.match[data-name="${sought}"]`, { timeout: WAIT });
  const searched = await page.evaluate(look);
  await page.fill("#search", "");
  step("sorted by tokens");
  await page.evaluate(() => { document.getElementById("left").scrollTop = 0; });
  await page.selectOption("#sort", "tokens");
  await page.waitForFunction(() => {
    const first = document.querySelector('#tree [data-name^="scope/agent/"]');
    return first && /tokens=\d/.test(first.textContent);
  }, null, { timeout: WAIT });
  const spenders = await page.$$eval('#tree [data-name^="scope/agent/"]', (rs) => rs.slice(0, 3).map((r) => r.dataset.name));
  // One more full draw, timed by the page itself.
  const renders = [];
  for (let i = 0; i < 5; i++) {
    await page.evaluate(() => new Promise((r) => { schedule(); requestAnimationFrame(() => requestAnimationFrame(r)); }));
    renders.push(await page.evaluate(() => +document.getElementById("tree").dataset.renderMs));
  }
  console.log(JSON.stringify({ top, bottom, searched, spenders, renders }));
});
