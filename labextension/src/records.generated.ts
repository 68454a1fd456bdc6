/* Generated from schema/job-records.schema.json (tfdist.jobrecords) by json-schema-to-typescript: do not edit (npm run gen:types). */

/**
 * A job's state: pending -> starting -> running -> succeeded | failed | stopped.
 */
export type JobState = "pending" | "starting" | "running" | "succeeded" | "failed" | "stopped";

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
  state: JobState;
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
   * where the job waits in the cluster's queue (Kueue) until admitted; null once it runs
   */
  queue?: QueueInfo | null;
  /**
   * why it ended (a Reason value); empty while it runs; `preempted` while it waits to be readmitted
   */
  reason?: string;
  /**
   * a detached job's results: pending (still running), waiting, taken (by an attach), none
   */
  results?: ("pending" | "waiting" | "taken" | "none") | null;
  state: JobState;
  /**
   * training steps done in the current fit
   */
  step?: number;
  tasks_started: number;
  tasks_total: number;
  user: string;
  [k: string]: unknown;
}
/**
 * Where a job waits in the cluster's queue (Kueue) before it is admitted: its place in line (1 is
 * next) and, when the queue says, which queue, how many workloads are ahead and the estimated wait.
 */
export interface QueueInfo {
  ahead?: number | null;
  position: number;
  queue?: string | null;
  scope?: ("queue" | "own") | null;
  wait_s?: number | null;
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
