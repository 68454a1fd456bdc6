/* Generated from schema/job-records.schema.json (tfdist.jobrecords) by json-schema-to-typescript: do not edit (npm run gen:types). */

/**
 * Generated from tfdist.jobrecords: do not edit (python -m tfdist.jobrecords).
 */
export interface TfdistRecords {
  GpuStatus?: GpuStatus;
  JobDetail?: JobDetail;
  JobList?: JobList;
  JobSummary?: JobSummary;
}
/**
 * This server's GPUs and its CPU/memory samples (the GPU status item).
 */
export interface GpuStatus {
  cpu_count: number;
  gpu_count: number;
  gpus: GpuName[];
  interval_s: number;
  samples: ServerSample[];
  [k: string]: unknown;
}
export interface GpuName {
  index: number;
  name: string;
  [k: string]: unknown;
}
export interface ServerSample {
  "cpu (%)": number;
  gpus: GpuSample[];
  "mem (%)": number;
  t: number;
  [k: string]: unknown;
}
export interface GpuSample {
  index: number;
  "mem_total (MiB)"?: number | null;
  "mem_used (MiB)"?: number | null;
  name?: string | null;
  "util (%)"?: number | null;
  [k: string]: unknown;
}
/**
 * One job's panel view: its tasks, the last minutes of samples, log tails and its summary.
 */
export interface JobDetail {
  logs: {
    [k: string]: string[];
  };
  /**
   * TensorFlow start-up lines left out of `logs` (the files keep them)
   */
  logs_hidden?: number;
  message: string;
  metrics: MetricsSample[];
  name: string;
  reason?: string;
  state: "pending" | "starting" | "running" | "succeeded" | "failed" | "stopped";
  summary: JobSummary;
  tasks: {
    [k: string]: TaskRecord;
  };
  user: string;
  [k: string]: unknown;
}
export interface MetricsSample {
  t: number;
  tasks: {
    [k: string]: TaskSample;
  };
  [k: string]: unknown;
}
export interface TaskSample {
  "cpu (%)"?: number | null;
  gpus?: GpuSample[];
  "rss (MiB)"?: number | null;
  [k: string]: unknown;
}
/**
 * One job in a list (the jobs panel, `%tfdist list`).
 */
export interface JobSummary {
  backend: string;
  cpu_total: number;
  created: number;
  /**
   * local backend: started with --detach (no kernel holds it)
   */
  detached?: boolean | null;
  ended: number | null;
  epoch: number;
  epochs: number | null;
  gpu_util: number[];
  /**
   * until when (epoch seconds) waiting results are kept
   */
  kept_until?: number | null;
  message: string;
  name: string;
  /**
   * why it ended (a Reason value); empty while it runs
   */
  reason?: string;
  /**
   * a detached job's results: pending (still running), waiting, taken (by an attach), none
   */
  results?: ("pending" | "waiting" | "taken" | "none") | null;
  state: "pending" | "starting" | "running" | "succeeded" | "failed" | "stopped";
  /**
   * training steps done in the current fit
   */
  step?: number;
  tasks_started: number;
  tasks_total: number;
  user: string;
  [k: string]: unknown;
}
export interface TaskRecord {
  exit_code?: number | null;
  gpus?: unknown[];
  restarts?: number;
  state: string;
  [k: string]: unknown;
}
export interface JobList {
  jobs: JobSummary[];
  user: string;
  [k: string]: unknown;
}
