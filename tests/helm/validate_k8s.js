// Validates Kubernetes objects (a JSON array on stdin) against the API
// schemas of the npm package kubernetes-models (types and required fields;
// unknown fields are not reported). Objects of kinds it does not know
// (ServiceMonitor) are listed as skipped. Prints one line per object and
// exits 1 if any is invalid. NODE_PATH must reach kubernetes-models.
const objects = JSON.parse(require("fs").readFileSync(0, "utf8"));
let bad = 0;
for (const o of objects) {
  const [group, version] = o.apiVersion.includes("/") ? o.apiVersion.split("/") : ["", o.apiVersion];
  const module = group ? `kubernetes-models/${group}/${version}` : `kubernetes-models/${version}`;
  let Kind;
  try {
    Kind = require(module)[o.kind];
  } catch (e) {
    Kind = undefined;
  }
  if (!Kind) {
    console.log(`skipped ${o.kind}/${o.metadata.name}: ${o.apiVersion} is not in kubernetes-models`);
    continue;
  }
  try {
    new Kind(o).validate();
    console.log(`valid ${o.kind}/${o.metadata.name}`);
  } catch (e) {
    bad++;
    console.log(`invalid ${o.kind}/${o.metadata.name}: ${e.message}`);
  }
}
process.exit(bad ? 1 : 0);
