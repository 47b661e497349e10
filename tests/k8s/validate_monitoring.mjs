// Validate PodMonitor and PrometheusRule objects (a JSON list on stdin) with the
// validators @kubernetes-models/prometheus-operator compiles from the Prometheus
// Operator's CRD schemas: types, required fields, enums, patterns. Prints one JSON
// object: {"<kind>/<name>": "error message" | null}.
import { PodMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PodMonitor";
import { PrometheusRule } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PrometheusRule";

const kinds = { PodMonitor, PrometheusRule };
let input = "";
for await (const chunk of process.stdin) input += chunk;
const results = {};
for (const doc of JSON.parse(input)) {
  const Model = kinds[doc.kind];
  const key = `${doc.kind}/${doc.metadata?.name}`;
  if (!Model) { results[key] = `no validator for kind ${doc.kind}`; continue; }
  try { new Model(doc).validate(); results[key] = null; }
  catch (e) { results[key] = e.message; }
}
console.log(JSON.stringify(results));
