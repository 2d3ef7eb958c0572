// The dashboard mounted in a service under a path of its own, behind the
// service's cookie. Usage: node mounted.cjs <page-url> <label> <png>
// Signs in (the cookie), opens the page, waits for the row of the agent
// labelled <label>, and prints a JSON line: the row's text, and every
// request the page made outside its path (there should be none).
"use strict";
const { WAIT, run } = require("./browser.cjs");

const [url, label, png] = process.argv.slice(2);

run(async (browser) => {
  const context = await browser.newContext();
  const at = new URL(url);
  await context.addCookies([{ name: "session", value: "signed-in", url: at.origin }]);
  const page = await context.newPage();
  const prefix = at.pathname.replace(/\/$/, "");
  const outside = [];
  page.on("request", (r) => {
    const u = new URL(r.url());
    if (u.origin === at.origin && !u.pathname.startsWith(prefix + "/")) outside.push(u.pathname);
  });
  await page.goto(url);
  const row = page.locator("#tree .row", { hasText: label }).first();
  await row.waitFor({ timeout: WAIT });
  const text = await row.textContent();
  await page.screenshot({ path: png, fullPage: true });
  console.log(JSON.stringify({ row: text, outside }));
});
