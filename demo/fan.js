// The tour's workflow: subagents in parallel, one line each (three, or one
// per topic given: --args '{"topics":["a","b"]}').
// cargo run --release -- workflow demo/fan.js --demo-model --dashboard --hold
const topics = args?.topics ?? ['actors', 'supervision', 'teardown'];
const lines = await Promise.all(topics.map(t => agent('Write one line about ' + t + '.', {label: t})));
return {lines};
